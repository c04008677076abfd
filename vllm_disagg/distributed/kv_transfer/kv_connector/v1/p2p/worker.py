"""Worker side of the P2P connector: drives the P2P engine from vLLM's hooks.

Per step (see ``kv_connector_model_runner_mixin.py``):

* ``bind_connector_metadata`` (before the forward pass): PUT_ASYNC sends start.
* ``start_load_kv``: new loads are registered with the engine (GET asks the
  prefill worker for them).
* ``save_kv_layer``: PUT_ASYNC hands each layer to the sender as soon as the
  forward pass computed it (on CUDA with an event, so the sender never reads
  a layer still being written).
* ``wait_for_save``: PUT sends and waits (blocking the model, its documented
  cost); GET keeps the blocks for the decode side to pull.
* ``get_transfer_results``: copies finished receives from the receive buffer
  into the KV cache (on the model thread and stream: explicit ordering), and
  reports finished sends and receives. A load that failed, or did not arrive
  by ``kv_load_timeout_s``, is still reported finished, and its blocks are
  reported invalid so vLLM's ``kv_load_failure_policy`` applies (recompute by
  default): one slow or dead prefill never blocks the batch.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
    P2pConfig,
    SendType,
    dp_rank_of,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
    KVLayout,
    P2pEngine,
    SendTransfer,
    SlotState,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.placement import (
    placed,
    warn_if_cores_are_shared,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.fingerprint import (
    model_fingerprint,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import (
    LoadSpec,
    P2pConnectorMetadata,
    SaveSpec,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pKVConnectorStats,
    P2pStatsRecorder,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import (
    create_transport,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.peers import format_addr, split_addr

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def shift_port(addr: str, offset: int) -> str:
    """``host:port`` of the peer worker ``offset`` ports after the instance address."""
    host, port = split_addr(addr)
    return format_addr(host, port + offset)


class P2pWorkerConnector:
    def __init__(self, vllm_config: VllmConfig, config: P2pConfig):
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        self.config = config
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        tp_size, pp_size = (
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
        )
        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
        # Symmetric parallelism: worker (pp, tp) talks to worker (pp, tp) of the peer.
        self.rank_offset = pp_rank * tp_size + tp_rank
        self.port = config.worker_port(
            dp_rank=dp_rank_of(parallel),
            tp_size=tp_size,
            pp_size=pp_size,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
        )
        self.stats = P2pStatsRecorder()
        self.fingerprint = model_fingerprint(vllm_config)
        self.engine: P2pEngine | None = None
        self.layer_index: dict[str, int] = {}

        self._meta: P2pConnectorMetadata | None = None
        self._loads: dict[
            str, tuple[LoadSpec, float]
        ] = {}  # request id -> (spec, deadline)
        self._streaming: list[SendTransfer] = []  # PUT_ASYNC sends of this step
        self._handled_at_bind: BaseException | None = None
        self._offered: list[SendTransfer] = []  # PUT sends of this step
        self._sends: dict[
            str, SendTransfer
        ] = {}  # request id -> its send, until reported
        self._finished_requests: set[str] = set()  # of those in _sends
        self._load_errors: set[int] = set()

    # --- set-up ---

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = KVLayout(kv_caches, self.block_size)
        self.layer_index = {name: i for i, name in enumerate(layout.layer_names)}
        config = self.config
        # Every thread started here (the engine's, ZMQ's, the transport's)
        # runs off the core vLLM pinned this model thread to (placement.py).
        warn_if_cores_are_shared()
        with placed():
            transport = create_transport(
                config.transport,
                layout.device,
                config.listen_host,
                advertise_host=config.host,
                data_port=config.data_port(self.port),
            )
            self.engine = P2pEngine(
                layout=layout,
                host=config.host,
                bind_host=config.listen_host,
                port=self.port,
                transport=transport,
                send_type=config.send_type.value,
                kv_buffer_size=config.kv_buffer_size,
                mem_pool_size_bytes=config.mem_pool_size_bytes,
                hold_timeout_s=config.kv_hold_timeout_s,
                secret=config.secret,
                stats=self.stats,
                model_fingerprint=self.fingerprint.digest,
                checksum=config.kv_checksum,
            )
        bound = format_addr(config.listen_host, self.port)
        logger.info(
            "P2P engine listening on %s: role %s, send_type %s, transport %s, "
            "kv_checksum %s, %d layers x %d blocks of %d bytes",
            self.engine.addr
            if bound == self.engine.addr
            else f"{bound} (advertised as {self.engine.addr})",
            config.role,
            config.send_type.value,
            transport.name,
            config.kv_checksum,
            layout.num_layers,
            layout.num_blocks,
            layout.page_bytes,
        )

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    # --- per step ---

    def bind(self, meta: P2pConnectorMetadata) -> None:
        self._meta = meta
        # sys.exc_info() walks up the stack: a step run from inside some
        # caller's `except` block sees that exception all along. Only one
        # that appears after bind was raised by this step's forward pass.
        self._handled_at_bind = sys.exc_info()[1]
        # PUT and PUT_ASYNC sends start here, before the forward pass (vLLM
        # calls start_load_kv after it when a step has no synchronous loads):
        # the Offer's round trip runs during the pass, and PUT_ASYNC's
        # save_kv_layer hands each layer over as soon as it is computed.
        # PUT's layers all go once wait_for_save says the pass is done.
        send_type = self.config.send_type
        if self.engine is not None and send_type is not SendType.GET:
            started = (
                self._streaming if send_type is SendType.PUT_ASYNC else self._offered
            )
            for save in meta.saves:
                xfer = self.engine.start_send(
                    save.key,
                    save.request_id,
                    shift_port(save.decode_addr, self.rank_offset),
                    save.block_ids,
                    all_saved=False,
                    prompt_digest=save.prompt_digest,
                )
                started.append(xfer)
                self._sends[save.request_id] = xfer

    def clear(self) -> None:
        self._meta = None
        self._handled_at_bind = None

    def start_load_kv(self) -> None:
        meta, engine = self._meta, self.engine
        if meta is None or engine is None:
            return
        now = time.monotonic()
        get_mode = self.config.send_type is SendType.GET
        for key in meta.unwanted:
            engine.abandon(
                key
            )  # an offer is refused (not_wanted); one received is freed
        for load in meta.loads:
            deadline = now + self.config.kv_load_timeout_s
            self._loads[load.request_id] = (load, deadline)
            # Blocks the decode side holds are not moved, unless measuring without it.
            skip = load.first_block if self.config.skip_cached_blocks else 0
            engine.expect(
                load.key,
                skip,
                deadline,
                get_from=shift_port(load.prefill_addr, self.rank_offset)
                if get_mode
                else None,
                prompt_digest=load.prompt_digest,
                prefill_addr=load.prefill_addr,
            )

    def save_kv_layer(self, layer_name: str) -> None:
        if not self._streaming:
            return
        layer = self.layer_index.get(layer_name)
        if layer is None:
            return
        event = None
        if self.engine.layout.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for xfer in self._streaming:
            xfer.layer_saved(layer, event)

    def wait_for_save(self) -> None:
        # vLLM's V1 model runner calls this in a `finally` around the forward
        # pass: when the pass raised, the layers it did not compute must not
        # go as KV. (The V2 runner skips the call when the pass raises; the
        # engine then dies and close() ends the sends.)
        raised, handled = sys.exc_info()[1], self._handled_at_bind
        self._handled_at_bind = None  # no caller's traceback kept past the step
        if raised is not None and raised is not handled:
            self._abandon_step(f"the forward pass raised {type(raised).__name__}")
            return
        meta, engine = self._meta, self.engine
        for xfer in self._streaming:
            xfer.all_saved()  # layers whose hook did not run (none expected) go now
        self._streaming.clear()
        # PUT: every layer is computed now; the model thread waits for the sends.
        offered, self._offered = self._offered, []
        for xfer in offered:
            xfer.all_saved()
        for xfer in offered:
            xfer.done.wait(max(0.0, xfer.deadline - time.monotonic()))
        if meta is None or engine is None or not meta.saves:
            return
        if self.config.send_type is SendType.GET:
            for s in meta.saves:
                self._hold_for_get(s)

    def _hold_for_get(self, save: SaveSpec) -> SendTransfer:
        xfer = self._sends[save.request_id] = self.engine.hold(
            save.key,
            save.request_id,
            save.block_ids,
            prompt_digest=save.prompt_digest,
            decode_addr=save.decode_addr,
        )
        return xfer

    def _abandon_step(self, reason: str) -> None:
        """Fail this step's sends: the KV in the cache is not what the pass
        would have written. PUT's tell their decodes (an Abort); GET's are
        filed failed, so the decode's Get is answered `gone`. Either way the
        decode recomputes at once, and the blocks are reported, so vLLM
        frees them. The model thread does not wait."""
        for xfer in [*self._streaming, *self._offered]:
            xfer.abandon(reason)
        self._streaming.clear()
        self._offered.clear()
        meta, engine = self._meta, self.engine
        if meta is None or engine is None or not meta.saves:
            return
        if self.config.send_type is SendType.GET:
            for s in meta.saves:
                engine.finish_send(self._hold_for_get(s), ok=False, reason=reason)
        logger.warning(
            "P2P: %d KV send(s) of this step failed: %s", len(meta.saves), reason
        )

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        engine = self.engine
        if engine is None:
            return results
        # Sends: report once the send ended *and* vLLM finished the request.
        self._finished_requests |= finished_req_ids & self._sends.keys()
        done = {x.request_id for x in engine.take_finished_sends()}
        for req_id in list(self._finished_requests):
            xfer = self._sends[req_id]
            if xfer.done.is_set() or req_id in done:
                results.finished_sending.add(req_id)
                self._finished_requests.discard(req_id)
                del self._sends[req_id]
        # Loads.
        now = time.monotonic()
        for req_id, (load, deadline) in list(self._loads.items()):
            if req_id in finished_req_ids:  # aborted while waiting
                engine.abandon(load.key)
                del self._loads[req_id]
                results.finished_recving.add(req_id)
                continue
            slot = engine.poll(load.key)
            if slot is None:
                if now <= deadline:
                    continue
                engine.abandon(load.key)
                self._fail_load(
                    load,
                    f"no KV from {load.prefill_addr} within "
                    f"kv_load_timeout_s={self.config.kv_load_timeout_s}",
                )
            elif (
                slot.state is SlotState.COMPLETE
                and slot.prompt_digest != load.prompt_digest
            ):
                # Arrived before this request was known, for another prompt.
                engine.release(slot)
                self.stats.record_digest_mismatch()
                self._fail_load(
                    load, "received KV belongs to another prompt (digest mismatch)"
                )
            elif slot.state is SlotState.COMPLETE:
                try:
                    engine.copy_into_cache(slot, load.block_ids, load.first_block)
                except ValueError as e:
                    self._fail_load(load, str(e))
                finally:
                    engine.release(slot)
            else:
                engine.release(slot)
                self._fail_load(load, slot.reason)
            del self._loads[req_id]
            results.finished_recving.add(req_id)
        return results

    def _fail_load(self, load: LoadSpec, reason: str) -> None:
        self.stats.record_failed_load()
        self._load_errors.update(load.block_ids)
        logger.warning(
            "request %s: KV load failed (%s); recomputing it", load.request_id, reason
        )

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> P2pKVConnectorStats | None:
        return self.stats.take()

    @property
    def addr(self) -> str:
        return format_addr(self.config.host, self.port)
