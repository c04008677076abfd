"""How one client request becomes a prefill request and a decode request.

For each request the router picks a decode instance D and a prefill
instance P, names both in the request (the ``X-Request-Id`` the connector
parses, and the same peers in ``kv_transfer_params``), sends P a prefill-only
version of the body and D the original body, and relays D's answer.

* ``sequential`` hand-off: D is sent the request once P answered. A failed P
  (connection error, 5xx, timeout) is retried on another P, at most
  ``max_retries`` times: nothing has reached the client yet.
* ``concurrent`` hand-off: P and D are sent the request at once, D waits for
  the KV. This saves P's round trip on every request; a P that fails cannot be
  retried (D already waits for that P), D recomputes the prompt instead.

Each leg has its own timeout, all of them within the request deadline
(``legs.py``; D's stream: ``relay.py``). Nothing in here raises into the
HTTP layer: every failure becomes a JSON error ``Reply`` (before the first
byte) or the end of the stream (after it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.exchange import (
    Exchange,
    client_request_id,
    forwarded_headers,
)
from vllm_disagg.router.health import InstanceHealth, LegFailure
from vllm_disagg.router.legs import DecodeLost, DecodeRefused, Legs
from vllm_disagg.router.metrics import Outcome, RouterMetrics
from vllm_disagg.router.migrator import Migrator
from vllm_disagg.router.models_cache import ModelsCache
from vllm_disagg.router.passthrough import Passthrough
from vllm_disagg.router.picking import Picker
from vllm_disagg.router.policy import Policies
from vllm_disagg.router.prompt_size import request_tokens
from vllm_disagg.router.registry import Instance, InstanceRegistry, Lease
from vllm_disagg.router.replies import JSON, Reply, content_type, relayed_headers
from vllm_disagg.router.selective import SelectiveDisaggregation
from vllm_disagg.router.validation import decode_alone_reason, over_context
from vllm_disagg.wire.discovery import Role
from vllm_disagg.wire.logs import RateLimitedLog

logger = logging.getLogger(__name__)

UPSTREAM_KEEPALIVE_S = 4.0
# ``handle``'s ``alone`` for requests that generate nothing (/tokenize, the
# render endpoints): one decode answers them, no prefill is skipped.
NOT_GENERATION = "not_generation"
# ``handle``'s ``alone`` for a body only Python's ``json`` reads (NaN,
# Infinity, lone surrogate escapes): vLLM takes it, msgspec does not. The
# decode answers it alone, sent as ``json`` encodes it.
STDLIB_JSON = "stdlib_json"
EXPIRY_SWEEP_S = 1.0  # how often silent instances are looked for without traffic


class RequestProxy:
    """Routes each request: picks its instances, runs its hand-off, retries
    what may be retried, and answers the requests one decode answers alone."""

    def __init__(
        self,
        config: RouterConfig,
        registry: InstanceRegistry,
        policies: Policies,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.registry = registry
        self.policies = policies
        self.metrics = metrics
        self.picker = Picker(registry, policies)
        self._session: aiohttp.ClientSession | None = None
        self.limited_log = RateLimitedLog(logger)
        self.health = InstanceHealth(
            registry,
            metrics,
            config.connect_timeout_s,
            lambda: self.session,
            self.limited_log,
        )
        self.legs = Legs(
            config,
            registry,
            metrics,
            self.health,
            lambda: self.session,
            self.limited_log,
        )
        self.migrator = Migrator(
            config,
            registry,
            metrics,
            self.health,
            self.legs,
            self.picker.pick,
            self.limited_log,
        )
        self.legs.resume = self.migrator.resume
        self.models = ModelsCache(
            registry, config.connect_timeout_s, lambda: self.session
        )
        self.passthrough = Passthrough(
            registry,
            metrics,
            self.health,
            config.connect_timeout_s,
            lambda: self.session,
            lambda candidates, body: policies.decode.select(candidates, body),
        )
        self.selective = SelectiveDisaggregation(
            config.decode_alone_below_tokens,
            config.prompt_bytes_per_token,
            config.prefix_index_max_entries,
            config.prefix_chunk_chars,
        )
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        """One client session for every upstream call, pooled connections;
        heartbeat expiry checked every second even while no request comes."""
        self.registry.on_removed.append(self._instance_removed)
        self.registry.on_stalled.append(self._instance_stalled)
        self._sweeper = asyncio.create_task(self._sweep_expired())
        self._session = aiohttp.ClientSession(
            # An idle connection is dropped before vLLM's (uvicorn's 5 s) keep-alive
            # ends: reusing one the server is closing would fail a request.
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.config.connect_timeout_s
            ),
        )

    async def close(self) -> None:
        if self._instance_removed in self.registry.on_removed:
            self.registry.on_removed.remove(self._instance_removed)
        if self._instance_stalled in self.registry.on_stalled:
            self.registry.on_stalled.remove(self._instance_stalled)
        self.health.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "RequestProxy.start() was not called"
        return self._session

    # --- entry -----------------------------------------------------------

    async def handle(
        self,
        endpoint: str,
        path: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        alone: str | None = None,
        client: str | None = None,
    ) -> Reply:
        """Route one request. ``alone``: why the endpoint goes to the decode
        alone whatever the body says (None: disaggregated where it can be)."""
        ex = self._exchange(
            endpoint,
            path,
            body,
            forwarded_headers(headers, client),
            self.config.request_timeout_s,
        )
        ex.alone = alone
        ex.stdlib_json = alone == STDLIB_JSON
        client_id = client_request_id(headers.get("X-Request-Id"))
        if client_id is not None:
            ex.request_id = client_id
        try:
            return await self._route(ex)
        except asyncio.CancelledError:
            ex.count(Outcome.CANCELLED)
            raise

    def _exchange(
        self,
        endpoint: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        timeout_s: float,
    ) -> Exchange:
        deadline = time.monotonic() + timeout_s
        return Exchange(endpoint, path, body, headers, deadline, self.metrics)

    async def unknown_model(
        self, endpoint: str, model: object, headers: Mapping[str, str]
    ) -> Reply | None:
        """The 404 vLLM answers when ``model`` is a name no instance serves."""
        if not isinstance(model, str):
            return None
        return await self._unknown_model(
            self._exchange(endpoint, "", {"model": model}, dict(headers), 0)
        )

    async def _unknown_model(self, ex: Exchange) -> Reply | None:
        """Upstream vLLM's 404 when no instance serves the request's model."""
        model = ex.model
        if model is None or not len(self.registry) or self.registry.serves_model(model):
            return None
        if (refused := await self._may_not_list_models(ex)) is not None:
            return refused
        return ex.error(
            Outcome.NO_INSTANCE,
            404,
            f"The model `{model}` does not exist. Valid aliases: "
            f"{', '.join(self.registry.model_names())}.",
            "model",
        )

    async def _may_not_list_models(self, ex: Exchange) -> Reply | None:
        """The decodes' 401 or 403 when this client may not list models.

        An error the router writes that names the fleet's models must not
        tell them to a client an ``--api-key`` decode would have refused
        first: ask one decode per model (``/v1/models``, cached per
        ``Authorization``), as the client's request would have."""
        authorization = next(
            (v for k, v in ex.headers.items() if k.lower() == "authorization"), None
        )
        listed = await self.models.list_models(authorization)
        if listed.status in (401, 403):
            ex.count(Outcome.BAD_REQUEST)
            return listed
        return None

    async def _route(self, ex: Exchange) -> Reply:
        model = ex.model
        if (unknown := await self._unknown_model(ex)) is not None:
            return unknown
        if model is None and len(self.registry.models()) > 1:
            # vllm serve takes a request without `model` for its one model;
            # with several, any choice could answer with the wrong one.
            if (refused := await self._may_not_list_models(ex)) is not None:
                return refused
            return ex.error(
                Outcome.BAD_REQUEST,
                400,
                "`model` is required: this router serves "
                f"{', '.join(self.registry.models())}",
                "model",
            )
        alone = ex.alone or decode_alone_reason(ex.body, ex.path)
        decode = (
            self.picker.pick(Role.DECODE, ex)
            if alone
            else self.picker.pick_paired_decode(ex)
        )
        if decode is None:
            return ex.error(
                Outcome.NO_INSTANCE,
                503,
                self.picker.no_decode_reason(ex),
            )
        if alone is None and over_context(ex.body, ex.path, decode.max_model_len):
            # vLLM answers its own 400 ("... cannot be greater than
            # max_model_len=..."), from the decode, with no prefill spent.
            alone = "invalid"
        if alone is None:
            alone = self.selective.reason(ex.body, decode)
        if alone != NOT_GENERATION:
            ex.prompt_tokens, ex.load_tokens = request_tokens(
                ex.body, self.config.prompt_bytes_per_token, ex.path
            )
        if alone is None:
            self.migrator.plan(ex)
        try:
            return await self._handoff(ex, decode, alone)
        except DecodeLost as lost:
            return await self.migrator.restart(
                ex, lost, self._handoff, self.picker.pick_paired_decode
            )

    async def _handoff(
        self, ex: Exchange, decode: Instance, alone: str | None
    ) -> Reply:
        # D counts as loaded from now on, prefill included: requests arriving
        # meanwhile see it, and a half-open D gets no second trial. The
        # decode leg releases the lease (or hands it to the stream relay);
        # a request that never gets there releases it here, with no verdict.
        lease = self.registry.reserve(decode, ex.load_tokens)
        try:
            if alone is not None:
                if alone != NOT_GENERATION:  # no prefill to fall back from
                    self.metrics.decode_prefill_fallbacks.labels(alone).inc()
                    self.metrics.count_route("decode_alone", alone)
                return await self.legs.decode(ex, lease, None)
            if self.config.handoff == "concurrent":
                return await self._concurrent(ex, lease)
            return await self._sequential(ex, lease)
        except DecodeRefused as refused:
            return await self._decode_elsewhere(ex, decode, refused)
        finally:
            lease.release(None)

    async def _decode_elsewhere(
        self, ex: Exchange, refused_by: Instance, refused: DecodeRefused
    ) -> Reply:
        """D refused the connection before a byte reached the client: try
        other decodes of its model. They prefill themselves (the KV went to
        the one that refused), so the answer costs a recompute, not a 502."""
        tried = {refused_by.instance_id, *ex.failed_decodes}
        for _ in range(self.config.max_retries):
            other = self.picker.pick(Role.DECODE, ex, tried, model=refused_by.model)
            if other is None:
                break
            tried.add(other.instance_id)
            self.metrics.decode_retries.inc()
            try:
                return await self.legs.decode(
                    ex, self.registry.reserve(other, ex.load_tokens), None
                )
            except DecodeRefused as again:
                refused = again
        return ex.error(Outcome.UPSTREAM_ERROR, 502, refused.message)

    # --- endpoints one decode answers alone ---------------------------------

    async def refused_by_decode(
        self,
        endpoint: str,
        path: str,
        raw: bytes,
        headers: Mapping[str, str],
        client: str | None = None,
    ) -> Reply | None:
        """A body that is not a JSON object, answered by a decode exactly as
        ``vllm serve`` answers it (FastAPI's validation error names the
        position), before any compute; None when no decode can say (then
        the router answers itself). Sent with the client's headers as every
        leg is (``forwarded_headers``: an ``--api-key`` decode checks the
        key first, its 401 is relayed). Only a 4xx is relayed."""
        ex = self._exchange(endpoint, path, {}, {}, self.config.connect_timeout_s + 5.0)
        decode = self.picker.pick(Role.DECODE, ex)
        if decode is None:
            return None
        sent = {**forwarded_headers(headers, client), "Content-Type": JSON}
        try:
            async with asyncio.timeout(ex.remaining()):
                async with self.session.post(
                    f"http://{decode.http_addr}{path}", data=raw, headers=sent
                ) as resp:
                    payload = await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self.health.judge(decode, e)
            return None
        if not 400 <= resp.status < 500:
            return None
        ex.count(Outcome.BAD_REQUEST)
        return Reply(resp.status, content_type(resp), payload, relayed_headers(resp))

    async def list_models(self, authorization: str | None = None) -> Reply:
        """``/v1/models`` of the fleet (``models_cache.py``)."""
        return await self.models.list_models(authorization)

    # --- hand-off styles -------------------------------------------------

    async def _sequential(self, ex: Exchange, lease: Lease) -> Reply:
        decode = lease.instance
        tried = {decode.instance_id}
        failures: list[str] = []
        for attempt in range(self.config.max_retries + 1):
            # The prefill computes the decode's model's KV, never another's.
            prefill = self.picker.pick(
                Role.PREFILL, ex, tried, model=decode.model, partner=decode
            )
            if prefill is None:
                break
            tried.add(prefill.instance_id)
            if attempt:
                self.metrics.prefill_retries.inc()
            result = await self.legs.prefill(ex, prefill, decode)
            ex.upstream_s += result.elapsed_s
            if result.ok:
                self._count_disaggregated()
                return await self.legs.decode(ex, lease, prefill)
            if result.reply is not None:
                ex.count(result.outcome)
                return result.reply
            failures.append(result.reason)
            self.limited_log.warning(
                "prefill-failed",
                "prefill on %s failed: %s",
                prefill.http_addr,
                result.reason,
            )
        return await self._without_prefill(ex, lease, failures)

    async def _concurrent(self, ex: Exchange, lease: Lease) -> Reply:
        decode = lease.instance
        prefill = self.picker.pick(
            Role.PREFILL, ex, {decode.instance_id}, model=decode.model, partner=decode
        )
        if prefill is None:
            return await self._without_prefill(ex, lease, [])
        self._count_disaggregated()
        task = asyncio.create_task(self._concurrent_prefill(ex, prefill, decode))
        return await self.legs.decode(ex, lease, prefill, task)

    async def _concurrent_prefill(
        self, ex: Exchange, prefill: Instance, decode: Instance
    ) -> None:
        result = await self.legs.prefill(ex, prefill, decode)
        if not result.ok:
            self.metrics.concurrent_prefill_failures.inc()
            self.limited_log.warning(
                "concurrent-prefill",
                "prefill on %s failed (%s) after decode on %s started: decode "
                "recomputes",
                prefill.http_addr,
                result.reason,
                decode.http_addr,
            )

    def _count_disaggregated(self) -> None:
        reason = "long_prompt" if self.selective.enabled else "always"
        self.metrics.count_route("disaggregated", reason)

    async def _without_prefill(
        self, ex: Exchange, lease: Lease, failures: list[str]
    ) -> Reply:
        """No P could take the request: D prefills itself if allowed, else an error."""
        decode = lease.instance
        reason = "prefill_failed" if failures else "no_prefill"
        if self.config.fallback_to_decode_prefill:
            self.metrics.decode_prefill_fallbacks.labels(reason).inc()
            self.metrics.count_route("decode_alone", reason)
            self.limited_log.warning(
                "fallback",
                "%s: %s prefills the request itself (%s)",
                reason,
                decode.http_addr,
                "; ".join(failures) or "no prefill instance",
            )
            return await self.legs.decode(ex, lease, None)
        if failures:
            return ex.error(
                Outcome.UPSTREAM_ERROR,
                502,
                f"prefill failed on {len(failures)} instance(s): "
                + "; ".join(failures),
            )
        return ex.error(
            Outcome.NO_INSTANCE, 503, "no healthy prefill instance is registered"
        )

    # --- instances leaving rotation ------------------------------------------

    async def _sweep_expired(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            self.registry.expire()

    def _instance_removed(self, instance: Instance, reason: str) -> None:
        """An instance whose heartbeats stopped (stopped, hung, or cut off)
        will not answer its prefill legs either: end them now, and each is
        retried on another prefill, instead of waiting out
        ``--prefill-timeout-s``. Other removals end nothing: a deregistered
        instance finishes what it has, a refused connection fails by itself."""
        if reason != "expired":
            return
        self.legs.end_prefill_legs(instance, LegFailure.INSTANCE_REMOVED)

    def _instance_stalled(self, instance: Instance) -> None:
        """An instance whose engine stopped stepping (a hung worker behind a
        live API server) will not finish its prefill legs either: end them
        now, each retried elsewhere, not at ``--prefill-timeout-s``."""
        self.legs.end_prefill_legs(instance, LegFailure.INSTANCE_STALLED)
