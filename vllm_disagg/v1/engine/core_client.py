"""Engine clients without waves.

With step-synchronized engines a client hands a request to one engine and is
done: no wave number on the request, no FIRST_REQ notice to the DP
coordinator, no START_DP_WAVE. Load-balancing stats still flow from the DP
coordinator (running with wave coordination off) to ``DPLBAsyncMPClient``.

Nor does a client keep a "DP engines running" flag. Upstream's clients set it
when they send a request and clear it on an output carrying
``wave_complete`` (sync client) or on the coordinator's wave state (async
clients); step-synchronized engines report no waves, so the flag would stay
set forever and ``LLMEngine.has_unfinished_requests()``, which ORs it in,
would keep ``LLM.generate()`` waiting for an output that never comes. Step-sync
engines run the passes their group owes on their own; a client waits only for
its own requests, which the output processor tracks.
"""

from __future__ import annotations

from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
from vllm.v1.engine.core_client import DPAsyncMPClient, DPLBAsyncMPClient, SyncMPClient


class _NoWaveState:
    def dp_engines_running(self) -> bool:
        # Nothing outside the engines tracks whether the DP group is stepping.
        return False


class _NoWaveAddRequest(_NoWaveState):
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_stats_update_task()
        request.client_index = self.client_index
        chosen_engine = self.get_core_engine_for_request(request)
        await self._send_input(EngineCoreRequestType.ADD, request, chosen_engine)
        self._ensure_output_queue_task()


class StepSyncSyncMPClient(_NoWaveState, SyncMPClient):
    """Sync client of ``LLM`` (one per DP rank in offline data parallelism)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_input(EngineCoreRequestType.ADD, request)


class StepSyncDPAsyncMPClient(_NoWaveAddRequest, DPAsyncMPClient):
    """External-LB DP client (one per DP rank's API server or ``AsyncLLM``)."""


class StepSyncDPLBAsyncMPClient(_NoWaveAddRequest, DPLBAsyncMPClient):
    """Internal-LB DP client (balances across all DP ranks)."""
