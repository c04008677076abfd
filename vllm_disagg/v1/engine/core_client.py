"""DP engine clients without waves.

With step-synchronized engines a client hands a request to one engine and is
done: no wave number on the request, no FIRST_REQ notice to the DP
coordinator, no START_DP_WAVE. Load-balancing stats still flow from the DP
coordinator (running with wave coordination off) to ``DPLBAsyncMPClient``.
"""

from __future__ import annotations

from vllm.v1.engine import EngineCoreRequest, EngineCoreRequestType
from vllm.v1.engine.core_client import DPAsyncMPClient, DPLBAsyncMPClient


class _NoWaveAddRequest:
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_stats_update_task()
        request.client_index = self.client_index
        chosen_engine = self.get_core_engine_for_request(request)
        await self._send_input(EngineCoreRequestType.ADD, request, chosen_engine)
        self._ensure_output_queue_task()


class StepSyncDPAsyncMPClient(_NoWaveAddRequest, DPAsyncMPClient):
    """External-LB DP client (one per DP rank's API server)."""


class StepSyncDPLBAsyncMPClient(_NoWaveAddRequest, DPLBAsyncMPClient):
    """Internal-LB DP client (balances across all DP ranks)."""
