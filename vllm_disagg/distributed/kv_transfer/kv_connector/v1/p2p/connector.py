"""``P2pNcclConnector``: point-to-point KV transfer for xPyD disaggregation.

A facade, as vLLM's NIXL connector is: the scheduler-role instance forwards
to :class:`~.scheduler.P2pSchedulerConnector`, the worker-role instance to
:class:`~.worker.P2pWorkerConnector`; no logic lives here. Select it with::

    --kv-transfer-config '{"kv_connector":"P2pNcclConnector","kv_role":"kv_producer",
      "kv_buffer_size":"1e1","kv_port":"21001","kv_connector_extra_config":{...}}'

See docs/p2p_connector.md for the protocol and every configuration key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import P2pConfig
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import (
    P2pConnectorMetadata,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.scheduler import (
    P2pSchedulerConnector,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pKVConnectorStats,
    P2pPromMetrics,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class P2pNcclConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        config = P2pConfig.from_vllm_config(vllm_config)
        # Also here, not only in the API server: offline LLM() starts no server.
        config.check_security()
        self._scheduler: P2pSchedulerConnector | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = P2pSchedulerConnector(vllm_config, config)
        else:
            from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.worker import (
                P2pWorkerConnector,
            )

            self._worker = P2pWorkerConnector(vllm_config, config)

    # --- scheduler side ---

    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    # --- worker side ---

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, P2pConnectorMetadata)
        self._worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker.clear()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request runs only after its KV is in the cache.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        return self._worker.get_transfer_results(finished_req_ids)

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> P2pKVConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        return self._scheduler.take_stats() if self._scheduler is not None else None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    # --- metrics (vLLM's connector stats hooks) ---

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> P2pKVConnectorStats:
        return (
            P2pKVConnectorStats(data=data)
            if data is not None
            else P2pKVConnectorStats()
        )

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ):
        return P2pPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
