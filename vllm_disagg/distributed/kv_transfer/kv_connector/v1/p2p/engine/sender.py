"""The send side: the engine's send API, GET holds, and the Get handler.

A :class:`~.transfers.SendTransfer` is queued on the thread of its peer
(peer.py), which offers it and writes its layers; in GET mode it is first
held in the :class:`~..send_state.SendTable` until the decode side's ``Get``
pulls it. Its state moves only here, by the table (send_state.py): every
handler is decide, then apply, under the engine's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.local import (
    Local,
    Rejects,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    SendTransfer,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Get,
    Refusal,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.send_state import (
    NOT_SENT_IN_TIME,
    GetAnswer,
    SendEvent,
    SendTable,
    decide_get,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pStatsRecorder,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.peers import PeerInfoError, canonical_host, split_addr

# One logger for the engine package, named as the module it was split from.
logger = init_logger(__package__)

GET_REPLY = {
    GetAnswer.PULL: Status.OK,
    GetAnswer.SENDING: Status.OK,  # decode asks again while its offer is on the way
    GetAnswer.GONE: Status.GONE,
    GetAnswer.NOT_READY: Status.NOT_READY,
}


class Sender:
    """The engine's send side: the GET holds by key, the sends that ended."""

    def __init__(
        self,
        local: Local,
        *,
        lock: threading.Lock,
        stats: P2pStatsRecorder,
        rejects: Rejects,
        submit: Callable[[str, SendTransfer], None],
        closing: threading.Event | None = None,
    ):
        self.local = local
        self.closing = closing  # the engine's: every transfer made here watches it
        self.lock = lock  # the engine's: one lock for both sides and the sweep
        self.stats = stats
        self.rejects = rejects
        self._submit = submit  # a transfer to the thread of its peer
        self.table = SendTable(limits.TOMBSTONE_TTL_S)
        self.finished: list[SendTransfer] = []

    def _transfer(
        self, key: str, request_id: str, peer: str, block_ids: list[int], **kw
    ) -> SendTransfer:
        return SendTransfer(
            key=key,
            request_id=request_id,
            peer=peer,
            block_ids=list(block_ids),
            num_layers=self.local.layout.num_layers,
            deadline=time.monotonic() + self.local.hold_timeout_s,
            closing=self.closing,
            **kw,
        )

    def start_send(
        self,
        key: str,
        request_id: str,
        peer: str,
        block_ids: list[int],
        *,
        all_saved: bool,
        prompt_digest: bytes,
    ) -> SendTransfer:
        """Queue the KV of ``block_ids`` for ``peer``; layers follow via
        layer_saved()."""
        xfer = self._transfer(
            key, request_id, peer, block_ids, prompt_digest=prompt_digest
        )
        if all_saved:
            xfer.all_saved()
        with self.lock:
            self.table.apply(xfer, SendEvent.QUEUE, time.monotonic())
        self._submit(peer, xfer)
        return xfer

    def hold(
        self,
        key: str,
        request_id: str,
        block_ids: list[int],
        *,
        prompt_digest: bytes,
        decode_addr: str | None = None,
    ) -> SendTransfer:
        """GET mode: keep the KV of ``block_ids`` until a peer pulls it or the hold
        expires.

        A second hold of one key (a retried id) replaces the first, which
        ends as a failed send at once: nothing could ever pull it."""
        xfer = self._transfer(
            key,
            request_id,
            "",
            block_ids,
            prompt_digest=prompt_digest,
            decode_host=canonical_host(split_addr(decode_addr)[0])
            if decode_addr
            else "",
        )
        xfer.all_saved()
        with self.lock:
            replaced = self.table.hold(xfer, time.monotonic())
        if replaced is not None:
            self.finish(
                replaced, ok=False, reason="replaced by a second hold of its key"
            )
        logger.debug(
            "P2P %s: holding %d blocks of %s for a Get",
            self.local.addr,
            len(block_ids),
            key,
        )
        return xfer

    def take_finished(self) -> list[SendTransfer]:
        with self.lock:
            done, self.finished = self.finished, []
        return done

    def finish(self, xfer: SendTransfer, *, ok: bool, reason: str = "") -> None:
        """The send of ``xfer`` ended: once (the sweep's backstop may race
        the send itself; the table ignores the second end)."""
        event = SendEvent.SENT if ok else SendEvent.FAIL
        with self.lock:
            if not self.table.apply(xfer, event, time.monotonic()):
                return
        self._ended(xfer, reason)

    def _ended(self, xfer: SendTransfer, reason: str) -> None:
        xfer.reason = reason
        if not xfer.ok:
            self.stats.record_failed_send()
            logger.warning(
                "P2P send of %s to %s failed: %s", xfer.key, xfer.peer, reason
            )
        with self.lock:
            self.finished.append(xfer)
        xfer.done.set()

    def sweep(self, now: float) -> None:
        """End the holds nobody pulled, and the pulled sends past their
        deadline that their peer thread did not end."""
        with self.lock:
            expired = self.table.expire(now)
        for xfer in expired:
            self._ended(xfer, NOT_SENT_IN_TIME)

    def on_get(self, msg: Get) -> Reply:
        """Decide from the key's state (send_state.decide_get), then apply."""
        try:
            host = canonical_host(split_addr(msg.sender_addr, "sender_addr")[0])
        except PeerInfoError as e:
            return self.rejects.refuse(msg.req_no, Refusal.MALFORMED, f"Get: {e}")
        with self.lock:
            xfer = self.table.get(msg.key)
            answer = decide_get(xfer, host)
            if answer is GetAnswer.PULL:
                self.table.apply(xfer, SendEvent.PULL, time.monotonic())
        if answer is GetAnswer.NOT_YOURS:
            return self.rejects.refuse(
                msg.req_no,
                Refusal.NOT_YOURS,
                f"Get of {msg.key} from {msg.sender_addr}: held for {xfer.decode_host}",
            )
        logger.debug(
            "P2P %s: Get of %s from %s: %s",
            self.local.addr,
            msg.key,
            msg.sender_addr,
            answer.value,
        )
        if answer is GetAnswer.PULL:
            xfer.peer = msg.sender_addr
            self._submit(msg.sender_addr, xfer)
        return Reply(req_no=msg.req_no, status=GET_REPLY[answer])
