"""Patch: engine clients that carry no wave state.

Upstream: ``vllm.v1.engine.core_client.SyncMPClient`` (looked up as a module
global by ``EngineCoreClient.make_client`` for ``LLM``), ``DPAsyncMPClient``
and ``DPLBAsyncMPClient`` (looked up by ``make_async_mp_client`` for
``AsyncLLM`` / ``vllm serve``). Replaced by the subclasses in
:mod:`vllm_disagg.v1.engine.core_client`.
"""

from __future__ import annotations

import vllm.v1.engine.core_client as upstream

from vllm_disagg.v1.engine.core_client import (
    StepSyncDPAsyncMPClient,
    StepSyncDPLBAsyncMPClient,
    StepSyncSyncMPClient,
)

REPLACEMENTS = {
    "SyncMPClient": StepSyncSyncMPClient,
    "DPAsyncMPClient": StepSyncDPAsyncMPClient,
    "DPLBAsyncMPClient": StepSyncDPLBAsyncMPClient,
}


def apply() -> None:
    for name, cls in REPLACEMENTS.items():
        setattr(upstream, name, cls)


def is_applied() -> bool:
    return all(getattr(upstream, name) is cls for name, cls in REPLACEMENTS.items())
