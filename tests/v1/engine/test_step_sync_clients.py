"""Engine clients keep no wave state (patch ``step-sync-clients``), no engines started.

Step-synchronized engines never send ``wave_complete``. Upstream's sync client
(``LLM``) sets ``engines_running`` on every request and clears it only on such
an output, so ``LLMEngine.has_unfinished_requests()`` would stay true after the
last output and ``LLM.generate()`` would block forever in ``get_output()``.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
from types import SimpleNamespace

import pytest
import vllm.v1.engine.core_client as upstream
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequestType
from vllm.v1.engine.llm_engine import LLMEngine

from vllm_disagg.patches import PATCHES
from vllm_disagg.patches.v1.engine import core_client as patch
from vllm_disagg.v1.engine.core_client import (
    StepSyncDPAsyncMPClient,
    StepSyncDPLBAsyncMPClient,
    StepSyncSyncMPClient,
)


def _upstream_class(name: str) -> type:
    """Upstream's class even when the patch is applied in this process."""
    cls = getattr(upstream, name)
    while cls.__module__ != upstream.__name__:
        cls = cls.__bases__[-1]
    assert cls.__name__ == name
    return cls


def _sync_client(cls: type) -> tuple[object, list]:
    """A DP=2 sync client with no sockets and no engine: what LLM.generate drives."""
    client = object.__new__(cls)
    client.is_dp = True
    client.engines_running = False
    client.outputs_queue = queue.Queue()
    sent: list = []
    client._send_input = lambda request_type, request: sent.append(
        (request_type, request)
    )
    return client, sent


def _llm_engine(client) -> LLMEngine:
    """LLMEngine whose own requests are all finished, on an MP client (no DP group)."""
    engine = object.__new__(LLMEngine)
    engine.dp_group = None
    engine.engine_core = client
    engine.output_processor = SimpleNamespace(has_unfinished_requests=lambda: False)
    return engine


def _generate_one_request(client) -> None:
    client.add_request(SimpleNamespace(request_id="r0"))
    # The engine streams outputs; the last one finishes the request. A
    # step-synchronized engine never puts wave_complete on any of them.
    client.outputs_queue.put(EngineCoreOutputs())
    client.get_output()


def test_upstream_sync_client_waits_for_wave_complete():
    """The failure this patch removes: upstream stays 'running' after the last
    output."""
    client, _ = _sync_client(_upstream_class("SyncMPClient"))
    _generate_one_request(client)
    assert client.dp_engines_running()
    assert _llm_engine(client).has_unfinished_requests()


def test_sync_client_not_running_after_last_output():
    client, sent = _sync_client(StepSyncSyncMPClient)
    client.add_request(SimpleNamespace(request_id="r0"))
    assert not client.dp_engines_running()
    client.outputs_queue.put(EngineCoreOutputs())
    assert isinstance(client.get_output(), EngineCoreOutputs)
    assert not client.dp_engines_running()
    assert not _llm_engine(client).has_unfinished_requests()
    assert [kind for kind, _ in sent] == [EngineCoreRequestType.ADD]


def test_sync_client_ignores_wave_fields():
    """Even an output carrying wave state changes nothing on the client."""
    client, _ = _sync_client(StepSyncSyncMPClient)
    client.add_request(SimpleNamespace(request_id="r0"))
    client.outputs_queue.put(EngineCoreOutputs(start_wave=3))
    client.get_output()
    assert not client.dp_engines_running()


def test_sync_client_still_raises_engine_errors():
    client, _ = _sync_client(StepSyncSyncMPClient)
    client.resources = SimpleNamespace(engine_dead=False)
    client.outputs_queue.put(RuntimeError("engine core died"))
    with pytest.raises(RuntimeError, match="engine core died"):
        client.get_output()


@pytest.mark.parametrize("cls", [StepSyncDPAsyncMPClient, StepSyncDPLBAsyncMPClient])
def test_async_clients_send_only_the_request(cls):
    """AsyncLLM / vllm serve: no wave stamp, no FIRST_REQ, never 'running'."""
    client = object.__new__(cls)
    client.client_index = 0
    # Wave state as the coordinator's stats task may have left it.
    client.engines_running = True
    client.current_wave = 7
    sent: list = []

    async def send_input(request_type, request, engine=None):
        sent.append((request_type, request.request_id, engine))

    client._send_input = send_input
    client._ensure_stats_update_task = lambda: None
    client._ensure_output_queue_task = lambda: None
    client.get_core_engine_for_request = lambda request: b"\x01\x00"
    client.first_req_send_socket = None  # any FIRST_REQ would fail here

    request = SimpleNamespace(request_id="r0", current_wave=0, client_index=None)
    asyncio.run(client.add_request_async(request))
    assert sent == [(EngineCoreRequestType.ADD, "r0", b"\x01\x00")]
    assert request.current_wave == 0
    assert request.client_index == 0
    assert not client.dp_engines_running()


def test_patch_replaces_every_client_the_factories_pick(monkeypatch):
    for name in patch.REPLACEMENTS:
        monkeypatch.setattr(upstream, name, _upstream_class(name))
    assert not patch.is_applied()

    patch.apply()
    assert patch.is_applied()
    assert upstream.SyncMPClient is StepSyncSyncMPClient
    assert upstream.DPAsyncMPClient is StepSyncDPAsyncMPClient
    assert upstream.DPLBAsyncMPClient is StepSyncDPLBAsyncMPClient
    # The factories look the classes up as module globals at call time, so
    # replacing the globals is enough.
    factories = upstream.EngineCoreClient
    assert "SyncMPClient" in factories.make_client.__code__.co_names
    make_async = inspect.unwrap(factories.make_async_mp_client)
    assert {"DPAsyncMPClient", "DPLBAsyncMPClient"} <= set(make_async.__code__.co_names)

    # One replacement undone is reported.
    monkeypatch.setattr(upstream, "SyncMPClient", _upstream_class("SyncMPClient"))
    assert not patch.is_applied()


def test_registry_entry_names_the_sync_client():
    entry = next(p for p in PATCHES if p.name == "step-sync-clients")
    assert entry.module == patch.__name__
    assert "SyncMPClient" in entry.upstream
    assert "wave_complete" in entry.why
