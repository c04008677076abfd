"""Scheduler side of the P2P connector: which requests load or send KV, and when.

Decode (``kv_consumer``, or ``kv_both`` named as the decode peer): a request
whose peers are known claims every prompt token its own prefix cache does not
hold, as an *asynchronous* load, so it waits in ``WAITING_FOR_REMOTE_KVS``
while the rest of the batch runs. The workers receive only the blocks after
the local prefix hit. A request is loaded at most once: after a preemption
it is recomputed locally (the prefill side has freed its copy by then).

Prefill (``kv_producer``, or ``kv_both`` named as the prefill peer): in the
step whose forward pass completes the prompt (the last chunk under chunked
prefill), the workers are told to send (PUT, PUT_ASYNC) or hold (GET) the
prompt's blocks, and ``request_finished`` delays freeing them until the
workers report the send finished (sent, refused or expired).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.utils.math_utils import cdiv

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import P2pConfig, dp_rank_of
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import (
    canonical_addr,
    format_addr,
    PeerInfo,
    PeerInfoError,
    parse_peer_info,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.registration import (
    start_registration,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.specs import (
    LoadSpec,
    P2pConnectorMetadata,
    SaveSpec,
)
from vllm_disagg.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

BAD_PEER_LOG_INTERVAL_S = 10.0


@dataclass
class _Prefill:
    peer: PeerInfo
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


class P2pSchedulerConnector:
    def __init__(self, vllm_config: VllmConfig, config: P2pConfig):
        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        self.addr = format_addr(
            config.host,
            config.instance_port(
                dp_rank=dp_rank_of(parallel),
                tp_size=parallel.tensor_parallel_size,
                pp_size=parallel.pipeline_parallel_size,
            ),
        )
        self._canonical_addr = canonical_addr(self.addr)
        # request id -> peers, for every live request that has them
        self._peers: dict[str, PeerInfo] = {}
        self._pending_loads: dict[str, LoadSpec] = {}
        self._loaded: set[str] = set()  # requests that asked for remote KV once
        self._prefills: dict[str, _Prefill] = {}
        self._sending: set[str] = set()  # prefills handed to the workers: delay their free
        self._last_bad_peer_log = -BAD_PEER_LOG_INTERVAL_S
        # One registration per engine core, i.e. per DP rank, named by the
        # rank's own control address (proxy_ip set; else None).
        self._registration = start_registration(vllm_config, config, self.addr)

    def shutdown(self) -> None:
        """Deregister from the routers (EngineCore.shutdown -> Scheduler.shutdown
        -> connector.shutdown)."""
        if self._registration is not None:
            self._registration.close()
            self._registration = None

    # --- which side of the transfer a request is on ---

    def on_new_request(self, request: Request) -> None:
        try:
            peer = parse_peer_info(request.request_id, request.kv_transfer_params)
        except PeerInfoError as e:
            now = time.monotonic()
            if now - self._last_bad_peer_log >= BAD_PEER_LOG_INTERVAL_S:
                self._last_bad_peer_log = now
                logger.warning(
                    "request %s: unusable P2P peer information (%s); it is computed "
                    "locally", request.request_id, e,
                )
            return
        if peer is not None:
            self._peers[request.request_id] = peer

    def _is_me(self, addr: str) -> bool:
        # Compared canonically: a proxy may spell this address differently.
        return canonical_addr(addr) == self._canonical_addr

    def _is_decode(self, peer: PeerInfo) -> bool:
        role = self.config.role
        if role == "kv_consumer":
            return True
        return role == "kv_both" and self._is_me(peer.decode_addr)

    def _is_prefill(self, peer: PeerInfo) -> bool:
        role = self.config.role
        if role == "kv_producer":
            return True
        return (role == "kv_both" and self._is_me(peer.prefill_addr)
                and not self._is_me(peer.decode_addr))  # fmt: skip

    # --- decode ---

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        peer = self._peers.get(request.request_id)
        if peer is None or request.request_id in self._loaded or not self._is_decode(peer):
            return 0, False
        remote = request.num_prompt_tokens - num_computed_tokens
        if remote <= 0:
            return 0, False
        return remote, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        peer = self._peers.get(req_id)
        if num_external_tokens <= 0 or peer is None or req_id in self._loaded:
            return
        num_prompt = request.num_prompt_tokens
        num_local = num_prompt - num_external_tokens
        num_blocks = cdiv(num_prompt, self.block_size)
        first_block = num_local // self.block_size
        block_ids = list(blocks.get_block_ids()[0])
        self._loaded.add(req_id)
        self._pending_loads[req_id] = LoadSpec(
            request_id=req_id,
            key=peer.key,
            prefill_addr=peer.prefill_addr,
            first_block=first_block,
            block_ids=block_ids[first_block:num_blocks],
            num_blocks=num_blocks,
        )

    # --- every step ---

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pConnectorMetadata:
        meta = P2pConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens

        for new in scheduler_output.scheduled_new_reqs:
            peer = self._peers.get(new.req_id)
            if peer is None or not self._is_prefill(peer):
                continue
            prefill = _Prefill(peer, new.prompt_len, list(new.block_ids[0]))
            self._prefills[new.req_id] = prefill
            self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))

        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            prefill = self._prefills.get(req_id)
            if prefill is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                prefill.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                prefill.block_ids.extend(new_ids[0])
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_save(self, meta: P2pConnectorMetadata, req_id: str, computed_after: int) -> None:
        prefill = self._prefills[req_id]
        if computed_after < prefill.num_prompt_tokens or prefill.num_prompt_tokens == 0:
            return
        del self._prefills[req_id]
        num_blocks = cdiv(prefill.num_prompt_tokens, self.block_size)
        meta.saves.append(
            SaveSpec(
                request_id=req_id,
                key=prefill.peer.key,
                decode_addr=prefill.peer.decode_addr,
                block_ids=prefill.block_ids[:num_blocks],
            )
        )
        self._sending.add(req_id)

    # --- end of a request ---

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._peers.pop(req_id, None)
        self._prefills.pop(req_id, None)
        self._loaded.discard(req_id)
        if req_id in self._sending:
            self._sending.discard(req_id)
            return True, None
        return False, None
