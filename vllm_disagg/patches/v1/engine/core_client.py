"""Patch: DP clients that carry no wave state.

Upstream: ``vllm.v1.engine.core_client.DPAsyncMPClient`` and
``DPLBAsyncMPClient``, looked up as module globals by
``EngineCoreClient.make_async_mp_client``. Replaced by the subclasses in
:mod:`vllm_disagg.v1.engine.core_client`.
"""

from __future__ import annotations

import vllm.v1.engine.core_client as upstream

from vllm_disagg.v1.engine.core_client import (
    StepSyncDPAsyncMPClient,
    StepSyncDPLBAsyncMPClient,
)


def apply() -> None:
    upstream.DPAsyncMPClient = StepSyncDPAsyncMPClient
    upstream.DPLBAsyncMPClient = StepSyncDPLBAsyncMPClient


def is_applied() -> bool:
    return (
        upstream.DPAsyncMPClient is StepSyncDPAsyncMPClient
        and upstream.DPLBAsyncMPClient is StepSyncDPLBAsyncMPClient
    )
