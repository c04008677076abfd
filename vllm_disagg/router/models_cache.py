"""``/v1/models`` of the fleet, as its decodes list their models.

Each entry is what one decode of the model answers (``root``,
``max_model_len``, ``permission``, aliases as their own entries), cached for
MODELS_CACHE_S per (model, client's ``Authorization``): a decode with
``--api-key`` answers only clients that may list models.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from vllm_disagg.router.registry import Instance, InstanceRegistry
from vllm_disagg.router.replies import JSON, Reply, content_type
from vllm_disagg.wire.discovery import Role

MODELS_CACHE_S = 10.0
MODELS_CACHE_ENTRIES = 256


class ModelsCache:
    def __init__(
        self,
        registry: InstanceRegistry,
        connect_timeout_s: float,
        session: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self.registry = registry
        self.connect_timeout_s = connect_timeout_s
        self._session = session
        # (model, client's Authorization) -> (until, names, entries)
        self._entries: dict[tuple, tuple[float, tuple[str, ...], list[dict]]] = {}

    async def list_models(self, authorization: str | None = None) -> Reply:
        """Every model a healthy decode serves, asked with the client's
        ``Authorization`` (a refusal, 401 or 403, is relayed). A model
        whose decodes do not answer in time gets the minimal entry."""
        by_model: dict[str, Instance] = {}
        for instance in self.registry.healthy(Role.DECODE):
            if instance.model is not None:
                by_model.setdefault(instance.model, instance)
        answers = await asyncio.gather(
            *(self._models_of(i, authorization) for i in by_model.values())
        )
        for answer in answers:
            if isinstance(answer, Reply):  # refused: the client may not list models
                return answer
        data = [entry for entries in answers for entry in entries]
        return Reply(200, JSON, msgspec.json.encode({"object": "list", "data": data}))

    async def _models_of(
        self, instance: Instance, authorization: str | None
    ) -> list[dict[str, Any]] | Reply:
        names = (instance.model, *instance.aliases)
        key = (instance.model, authorization)
        cached = self._entries.get(key)
        now = time.monotonic()
        if cached is not None and cached[0] > now and cached[1] == names:
            return cached[2]
        entries: list[dict[str, Any]] = []
        headers = {"Authorization": authorization} if authorization else {}
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                async with self._session().get(
                    f"http://{instance.http_addr}/v1/models", headers=headers
                ) as resp:
                    payload = await resp.read()
            if resp.status in (401, 403):
                return Reply(resp.status, content_type(resp), payload)
            listed = msgspec.json.decode(payload) if resp.status == 200 else {}
            data = listed.get("data") if isinstance(listed, dict) else None
            if isinstance(data, list):
                entries = [
                    e for e in data if isinstance(e, dict) and e.get("id") in names
                ]
        except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError):
            pass
        if not entries:
            created = int(time.time())
            entries = [
                {"id": n, "object": "model", "created": created, "owned_by": "vllm"}
                for n in names
            ]
        else:
            if len(self._entries) >= MODELS_CACHE_ENTRIES:
                self._entries.clear()  # many clients' keys: start over
            self._entries[key] = (now + MODELS_CACHE_S, names, entries)
        return entries
