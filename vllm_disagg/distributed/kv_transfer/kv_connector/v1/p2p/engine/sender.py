"""The send side: one transfer's progress, GET holds, and the engine's send API.

A :class:`SendTransfer` is queued on the thread of its peer (peer.py), which
offers it and writes its layers; in GET mode it is first kept as a
:class:`Hold` until the decode side's ``Get`` pulls it (:meth:`_on_get`).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Get,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    TransportError,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.peers import PeerInfoError, canonical_host, split_addr

if TYPE_CHECKING:
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
        KVLayout,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
        P2pStatsRecorder,
    )

# One logger for the engine package, named as the module it was split from.
logger = init_logger(__package__)


@dataclass(eq=False)
class SendTransfer:
    """The KV of one finished prefill, on its way to one peer worker."""

    key: str
    request_id: str
    peer: str
    block_ids: list[int]
    num_layers: int
    deadline: float
    prompt_digest: bytes = b""
    decode_host: str = ""  # GET: only a Get from this host may pull it (canonical)
    finished: bool = False  # _finish_send ran
    layers_ready: int = 0
    events: dict[int, torch.cuda.Event] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    reason: str = ""
    cond: threading.Condition = field(default_factory=threading.Condition)

    def layer_saved(self, layer: int, event: torch.cuda.Event | None) -> None:
        with self.cond:
            if event is not None:
                self.events[layer] = event
            self.layers_ready = max(self.layers_ready, layer + 1)
            self.cond.notify_all()

    def all_saved(self) -> None:
        self.layer_saved(self.num_layers - 1, None)

    def wait_layer(self, layer: int) -> None:
        with self.cond:
            while self.layers_ready <= layer:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"layer {layer} was never saved")
                self.cond.wait(min(left, limits.POLL_INTERVAL_S))
            event = self.events.get(layer)
        if event is not None:
            while not event.query():
                if time.monotonic() > self.deadline:
                    raise TransportError(f"layer {layer} compute did not finish")
                time.sleep(0.0002)


class HoldState(enum.Enum):
    """GET, prefill side: where the KV kept for one key is."""

    HELD = "held"  # kept until a Get pulls it or kv_hold_timeout_s passes
    SENDING = "sending"  # pulled: its send runs (a repeated Get is answered ok)
    RELEASED = "released"  # sent, failed or expired: a Get is answered gone


@dataclass(eq=False)
class Hold:
    """GET, prefill side: the KV kept for one key, and until when."""

    state: HoldState
    xfer: SendTransfer
    until: float  # HELD: expiry; SENDING: the send's deadline; RELEASED: forgotten then


@dataclass
class GetJob:
    """GET, decode side: ask the prefill worker to offer ``key`` now."""

    key: str
    skip_blocks: int
    deadline: float
    on_failure: Callable[[str], None]


class SenderMixin:
    """P2pEngine's send side (core.py sets up the state it uses)."""

    addr: str
    layout: KVLayout
    hold_timeout_s: float
    stats: P2pStatsRecorder
    _lock: threading.Lock
    _holds: dict[str, Hold]  # GET: one HoldState per key (HELD -> SENDING -> RELEASED)
    _finished_sends: list[SendTransfer]

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
        xfer = SendTransfer(
            key=key,
            request_id=request_id,
            peer=peer,
            block_ids=list(block_ids),
            num_layers=self.layout.num_layers,
            deadline=time.monotonic() + self.hold_timeout_s,
            prompt_digest=prompt_digest,
        )
        if all_saved:
            xfer.all_saved()
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
        xfer = SendTransfer(
            key=key,
            request_id=request_id,
            peer="",
            block_ids=list(block_ids),
            num_layers=self.layout.num_layers,
            deadline=time.monotonic() + self.hold_timeout_s,
            prompt_digest=prompt_digest,
            decode_host=canonical_host(split_addr(decode_addr)[0])
            if decode_addr
            else "",
        )
        xfer.all_saved()
        with self._lock:
            old = self._holds.get(key)
            self._holds[key] = Hold(HoldState.HELD, xfer, xfer.deadline)
        # A transfer already being sent ends on its own; a held one never would.
        if old is not None and old.state is HoldState.HELD:
            self._finish_send(
                old.xfer, ok=False, reason="replaced by a second hold of its key"
            )
        logger.debug(
            "P2P %s: holding %d blocks of %s for a Get", self.addr, len(block_ids), key
        )
        return xfer

    def take_finished_sends(self) -> list[SendTransfer]:
        with self._lock:
            done, self._finished_sends = self._finished_sends, []
        return done

    def _finish_send(self, xfer: SendTransfer, *, ok: bool, reason: str = "") -> None:
        with self._lock:
            if xfer.finished:  # once: the sweep's backstop may race the send itself
                return
            xfer.finished = True
        xfer.ok, xfer.reason = ok, reason
        with self._lock:
            hold = self._holds.get(xfer.key)
            if (
                hold is not None
                and hold.xfer is xfer
                and hold.state is HoldState.SENDING
            ):
                hold.state = HoldState.RELEASED
                hold.until = time.monotonic() + limits.TOMBSTONE_TTL_S
        if not ok:
            self.stats.record_failed_send()
            logger.warning(
                "P2P send of %s to %s failed: %s", xfer.key, xfer.peer, reason
            )
        with self._lock:
            self._finished_sends.append(xfer)
        xfer.done.set()

    def _on_get(self, msg: Get) -> Reply:
        try:
            sender_host = canonical_host(split_addr(msg.sender_addr, "sender_addr")[0])
        except PeerInfoError as e:
            return self._refuse(msg.req_no, "malformed", f"Get: {e}")
        with self._lock:
            hold = self._holds.get(msg.key)
            state = hold.state if hold is not None else None
            # KV goes only to the decode host the request named (any DP rank
            # there: the rank that runs the request pulls with its own address).
            wrong = hold is not None and hold.xfer.decode_host not in ("", sender_host)
            xfer = hold.xfer if state is HoldState.HELD and not wrong else None
            if xfer is not None:
                hold.state = HoldState.SENDING  # until _finish_send releases it
                hold.until = xfer.deadline
            sending = state is HoldState.SENDING
            released = state is HoldState.RELEASED
        if wrong:
            return self._refuse(
                msg.req_no,
                "not_yours",
                f"Get of {msg.key} from {msg.sender_addr}: held for "
                f"{hold.xfer.decode_host}",
            )
        logger.debug(
            "P2P %s: Get of %s from %s: %s",
            self.addr,
            msg.key,
            msg.sender_addr,
            "held" if xfer else "released" if released else "not held yet",
        )
        if sending:  # decode asks again while its offer is on the way
            return Reply(req_no=msg.req_no, status=Status.OK)
        if xfer is None:
            return Reply(
                req_no=msg.req_no, status=Status.GONE if released else Status.NOT_READY
            )
        xfer.peer = msg.sender_addr
        self._submit(msg.sender_addr, xfer)
        return Reply(req_no=msg.req_no, status=Status.OK)
