"""The P2P engine: one per worker, moves KV blocks to and from peer workers.

Control plane: a ZMQ ROUTER socket bound at this worker's port (the listener
thread) and one DEALER socket per peer (owned by that peer's thread). Data
plane: a :class:`~.transport.base.Transport` channel per (sender, receiver)
pair, created lazily on first contact and reused; each channel carries data
in one direction, from the side that created it.

One transfer, whatever the send mode, is always the same exchange, started by
the side that holds the KV (the *sender*):

1. ``Offer(key, num_blocks)`` on the control plane;
2. the receiver reserves room (receive buffer, else the host pool), queues the
   expectation on the channel's receive thread and replies with how many
   leading blocks it already holds (``skip_blocks``: its own prefix cache), or
   ``no_space`` / ``not_wanted``;
3. the sender writes one data message per layer with blocks
   ``[skip_blocks:]``; in PUT_ASYNC it writes layer *i* as soon as the forward
   pass has computed it.

GET only adds a step 0: the decode side asks the prefill side (``Get``) to
make the offer now. Because each channel direction has one sending thread that
finishes one transfer before offering the next, and the receiver queues
expectations in the order it accepts offers, the n-th message on a channel
always belongs to the n-th accepted offer: no tags are needed, which is what
NCCL requires.

Every wait has a deadline. A failed channel is closed and every transfer
queued on it fails; the next transfer sets up a new one. A receive that does
not complete by its deadline is reported by the worker as a load failure, and
vLLM recomputes (``kv_load_failure_policy``).

Threads never touch the KV cache of a request they do not own: the sender
reads blocks that stay allocated (delayed free) until the worker reports the
send finished; the receiver writes only into its own buffer, and the model
thread copies the buffer into the KV cache (:meth:`P2pEngine.take_received`).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.wire.peers import (
    PeerInfoError,
    canonical_addr,
    canonical_host,
    format_addr,
    source_host,
    split_addr,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Get,
    Hello,
    LayoutSpec,
    Offer,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.recv_state import (
    Event,
    RecvState,
    RecvTable,
    Timeouts,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import P2pStatsRecorder
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.tensor_pool import (
    PoolAllocation,
    TensorMemoryPool,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
    Transport,
    TransportError,
    addresses_of,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.frames import harden_listener
from vllm_disagg.wire.logs import RateLimitedLog

logger = init_logger(__name__)

POLL_INTERVAL_S = 0.05
GET_RETRY_INTERVAL_S = 0.05
# An idle receive thread checks this often whether its sender hung up.
IDLE_CHECK_INTERVAL_S = 1.0
# A peer thread with nothing to do for this long exits and frees its socket
# and channel (a new one is made on the next transfer to that peer).
PEER_IDLE_S = 60.0
# Inbound channels (one receive thread each) at most; Hellos beyond are refused.
MAX_INBOUND_CHANNELS = 256
# After prefill accepted a Get, decode asks again this often while no offer
# has come: prefill answers "ok" while its send is under way and "gone" once
# it ended (sent or failed), so a send that failed before its offer reached
# decode fails the load now, not at kv_load_timeout_s.
GET_CONFIRM_INTERVAL_S = 1.0
# A live peer answers a control message in milliseconds (0.72 s was the worst
# seen on a loaded 2-core machine); waiting the whole kv_hold_timeout_s for a
# dead one held every transfer queued behind it.
CONTROL_REPLY_TIMEOUT_S = 10.0
# After a peer left a control message unanswered, transfers to it fail at
# once for this long instead of each waiting CONTROL_REPLY_TIMEOUT_S again.
PEER_RETRY_AFTER_S = 5.0
# A Hello is accepted only this close to its sender's clock (replays of a
# captured one are refused: its channel id is remembered twice as long).
MAX_HELLO_AGE_S = 300.0
# An accepted Hello's data connection must be made this soon (the sender
# connects right after the reply); until then its thread counts as busy.
CHANNEL_SETUP_TIMEOUT_S = 15.0
# Receive-side keys tracked at most (expected, receiving, ready, closed).
MAX_RECV_KEYS = 65536
# How long a GET answered "released" is remembered, so a late Get gets "gone".
TOMBSTONE_TTL_S = 300.0
LOG_INTERVAL_S = 10.0


def zmq_endpoint(addr: str) -> str:
    return f"tcp://{addr}"


# --- the local KV cache, as blocks of bytes ------------------------------------


class KVLayout:
    """The registered KV cache tensors seen as ``layers x blocks`` of bytes.

    vLLM 0.32 gives every attention layer a view whose dim 0 is the block
    (logical ``[B, H, N, C]`` for every physical layout, see
    ``vllm/v1/kv_cache_layout.py``); when each block is contiguous in memory
    (the CPU backend's LBHNC, most GPU layouts) blocks are sent straight from
    the cache as byte views, otherwise they are gathered first.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int):
        if not kv_caches:
            raise ValueError("P2pNcclConnector: no KV cache tensors were registered")
        self.layer_names = list(kv_caches)
        self.tensors = [kv_caches[name] for name in self.layer_names]
        first = self.tensors[0]
        for name, t in zip(self.layer_names, self.tensors):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(
                    "P2pNcclConnector needs one KV cache shape for every layer; "
                    f"{name} has {tuple(t.shape)} {t.dtype}, "
                    f"{self.layer_names[0]} has {tuple(first.shape)} {first.dtype}"
                )
        self.num_blocks = first.shape[0]
        self.block_size = block_size
        self.dtype = first.dtype
        self.device = first.device
        self.page_bytes = first[0].numel() * first.element_size()
        self.blocks_contiguous = all(t[0].is_contiguous() for t in self.tensors)

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

    @property
    def spec(self) -> LayoutSpec:
        return LayoutSpec(
            num_layers=self.num_layers,
            page_bytes=self.page_bytes,
            block_size=self.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def read_blocks(self, layer: int, block_ids: list[int]) -> list[torch.Tensor]:
        """The bytes of ``block_ids`` of one layer, in order, without a copy if possible."""
        t = self.tensors[layer]
        if self.blocks_contiguous:
            return [t[b].reshape(-1).view(torch.uint8) for b in block_ids]
        index = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        return [t.index_select(0, index).reshape(-1).view(torch.uint8)]

    def write_blocks(self, layer: int, block_ids: list[int], src: torch.Tensor) -> bool:
        """Copy ``len(block_ids)`` pages of bytes from ``src`` into the cache;
        True when that was an asynchronous copy from another device (host
        memory into a CUDA cache) that may still be reading ``src``."""
        t = self.tensors[layer]
        pages = src.view(t.dtype).view(len(block_ids), *t.shape[1:])
        crossing = pages.device != t.device
        if crossing:
            pages = pages.to(t.device, non_blocking=True)
        index = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        t.index_copy_(0, index, pages)
        return crossing and t.device.type == "cuda"


def _source_ip(frame: zmq.Frame) -> str | None:
    """The IP address a message came from (libzmq's Peer-Address), canonical."""
    try:
        return source_host(frame.get("Peer-Address"))
    except (zmq.ZMQError, KeyError, AttributeError):
        return None


def check_compatible(local: LayoutSpec, remote: LayoutSpec) -> str | None:
    """Why KV from ``remote`` cannot be copied into ``local`` blocks, or None."""
    for name in ("num_layers", "page_bytes", "block_size", "dtype"):
        if getattr(local, name) != getattr(remote, name):
            return (
                f"KV layout mismatch: {name} is {getattr(remote, name)} on the peer and "
                f"{getattr(local, name)} here (same model, dtype and --block-size needed)"
            )
    return None


# --- receiving ---------------------------------------------------------------


class SlotState(enum.Enum):
    RECEIVING = "receiving"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(eq=False)
class RecvSlot:
    """Room for one transfer: ``num_layers x (num_blocks - skip)`` pages."""

    key: str
    num_blocks: int  # blocks of the whole prompt on the sender
    skip_blocks: int
    page_bytes: int
    num_layers: int
    tensor: torch.Tensor  # uint8, the whole transfer, layer-major
    pool_alloc: PoolAllocation | None
    deadline: float
    prompt_digest: bytes = b""  # the sender's: the worker copies only on a match
    state: SlotState = SlotState.RECEIVING
    reason: str = ""

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def blocks_held(self) -> int:
        return self.num_blocks - self.skip_blocks

    def layer(self, i: int) -> torch.Tensor:
        n = self.blocks_held * self.page_bytes
        return self.tensor[i * n : (i + 1) * n]


class _InboundChannel:
    """A channel a peer created to send to us, with its receive thread."""

    def __init__(self, engine: P2pEngine, channel_id: str, peer: str, finish, deadline: float,
                 route: bytes = b""):
        self.engine = engine
        self.channel_id = channel_id
        self.peer = peer
        self.route = route  # the control connection its Hello came on: offers must too
        self.queue: queue.Queue[RecvSlot] = queue.Queue()
        self.channel: Channel | None = None
        self.broken = False
        self._finish = finish
        self._setup_deadline = deadline
        self.thread = threading.Thread(
            target=self._run, name=f"p2p-recv-{peer}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        try:
            self._receive()
        finally:
            with self.engine._lock:
                self.engine._recv_threads -= 1

    def _receive(self) -> None:
        engine = self.engine
        try:
            channel = self._finish(self._setup_deadline)
        except TransportError as e:
            self._break(f"channel set-up failed: {e}")
            return
        with engine._lock:
            broken, self.channel = self.broken, channel
            # A sender uses only its newest channel to us: an older one from
            # the same address belongs to a sender that restarted or gave up
            # on it. Replaced only now that this one is set up, so a replayed
            # Hello that cannot complete breaks nothing.
            stale = [c for c in engine._inbound.values() if c.peer == self.peer and c is not self]
        if broken:  # replaced or closed while it was being set up
            channel.close()
            return
        for old in stale:
            old._break("the sender opened a new channel")
        next_check = time.monotonic() + IDLE_CHECK_INTERVAL_S
        while not engine.stopped.is_set() and not self.broken:
            try:
                slot = self.queue.get(timeout=POLL_INTERVAL_S)
            except queue.Empty:
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + IDLE_CHECK_INTERVAL_S
                    if self.channel.peer_closed():
                        # The sender's process is gone (its socket closed):
                        # free the thread and the socket now, not never.
                        self._break("the sender closed the channel")
                        return
                continue
            start = time.monotonic()
            try:
                for i in range(slot.num_layers):
                    engine._recv_layer(self.channel, slot, i)
            except TransportError as e:
                engine._finish_slot(slot, ok=False, reason=f"receive failed: {e}")
                self._break(str(e))
                return
            engine.stats.record_recv(slot.nbytes, slot.blocks_held, time.monotonic() - start)
            engine._finish_slot(slot, ok=True)

    def _break(self, reason: str) -> None:
        engine = self.engine
        with engine._lock:
            # Under the engine lock: an offer either sees the channel broken,
            # or is queued before the drain below and failed by it.
            self.broken = True
            if engine._inbound.get(self.channel_id) is self:
                del engine._inbound[self.channel_id]
        engine._log_limited("channel_closed", f"P2P channel from {self.peer} closed: {reason}")
        if self.channel is not None:
            self.channel.close()
        while True:
            try:
                slot = self.queue.get_nowait()
            except queue.Empty:
                break
            engine._finish_slot(slot, ok=False, reason=f"channel closed: {reason}")


# --- sending -----------------------------------------------------------------


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
                self.cond.wait(min(left, POLL_INTERVAL_S))
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
class _Hold:
    state: HoldState
    xfer: SendTransfer
    until: float  # HELD: expiry; SENDING: the send's deadline; RELEASED: forgotten then


@dataclass
class _GetJob:
    key: str
    skip_blocks: int
    deadline: float
    on_failure: Callable[[str], None]


class _Peer:
    """Everything we send to one peer worker: control requests and data, in order."""

    def __init__(self, engine: P2pEngine, addr: str):
        self.engine = engine
        self.addr = addr
        self.jobs: queue.Queue[SendTransfer | _GetJob] = queue.Queue()
        self.channel: Channel | None = None
        self.channel_id = ""
        self._sock: zmq.Socket | None = None
        self._req_no = itertools.count(1)
        # GET jobs answered "not ready", each with the time to ask again:
        # they wait here, not in the thread, so other transfers go first.
        self._later: list[tuple[float, int, _GetJob]] = []
        self._later_no = itertools.count()
        self.silent_until = 0.0  # the peer left a request unanswered: fail fast until then
        self.thread = threading.Thread(target=self._run, name=f"p2p-peer-{addr}", daemon=True)
        self.thread.start()

    # control requests

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self.engine.zmq_ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, 2 * proto.MAX_FRAME_BYTES)
            if self.addr.startswith("["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(zmq_endpoint(self.addr))
            self._sock = sock
        return self._sock

    def _reset_socket(self) -> None:
        # Queued requests of a timed-out exchange must not be delivered late.
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def request(self, make_msg: Callable[[int], proto._Msg], deadline: float) -> Reply:
        """Send a control message and wait for its Reply until ``deadline``, at
        most CONTROL_REPLY_TIMEOUT_S; a peer that does not answer is not asked
        again for PEER_RETRY_AFTER_S."""
        deadline = min(deadline, time.monotonic() + CONTROL_REPLY_TIMEOUT_S)
        req_no = next(self._req_no)
        sock = self._socket()
        msg = make_msg(req_no)
        sock.send_multipart(proto.seal(self.engine.secret, msg))
        sent_at = time.monotonic()
        while True:
            now = time.monotonic()
            left_ms = int((deadline - now) * 1000)
            if left_ms <= 0 or self.engine.stopped.is_set():
                self._reset_socket()
                self.silent_until = now + PEER_RETRY_AFTER_S
                raise TransportError(f"no reply to {type(msg).__name__} from {self.addr} "
                                     f"in {now - sent_at:.1f} s")  # fmt: skip
            if not sock.poll(min(left_ms, 100)):
                continue
            frames = sock.recv_multipart()
            try:
                msg = proto.open_frame(self.engine.secret, frames)
            except proto.FrameError as e:
                self.engine._reject(e.kind, f"from {self.addr}: {e}")
                continue
            if isinstance(msg, Reply) and msg.req_no == req_no:
                return msg
            # A late reply to an earlier request: ignore.

    # the thread

    def _run(self) -> None:
        engine = self.engine
        idle_since = time.monotonic()
        while not engine.stopped.is_set():
            now = time.monotonic()
            wait = POLL_INTERVAL_S
            if self._later:
                wait = min(wait, max(0.0, self._later[0][0] - now))
            try:
                job = self.jobs.get(timeout=wait)
            except queue.Empty:
                job = None
            if job is not None:
                self._do(job)
            now = time.monotonic()
            while self._later and self._later[0][0] <= now:
                self._do(heapq.heappop(self._later)[2])
            if job is not None or self._later:
                idle_since = now
            elif now - idle_since > PEER_IDLE_S and engine._retire_peer(self):
                break
        self._reset_socket()
        if self.channel is not None:
            self.channel.close()

    def _do(self, job: SendTransfer | _GetJob) -> None:
        left = self.silent_until - time.monotonic()
        if left > 0:
            reason = (f"peer {self.addr} left a request unanswered; not asked again "
                      f"for {left:.1f} s")  # fmt: skip
            if isinstance(job, _GetJob):
                job.on_failure(reason)
            else:
                self.engine._finish_send(job, ok=False, reason=reason)
            return
        try:
            if isinstance(job, _GetJob):
                self._get(job)
            else:
                self._send(job)
        except Exception as e:  # noqa: BLE001 - a job's bug must not kill the peer's thread
            logger.exception("P2P peer thread %s: a job failed", self.addr)
            if isinstance(job, _GetJob):
                job.on_failure(f"internal error: {e}")
            elif not job.done.is_set():
                self.engine._finish_send(job, ok=False, reason=f"internal error: {e}")

    def _get(self, job: _GetJob) -> None:
        """Ask once; a "not ready" answer puts the job back with a retry time,
        so a key the prefill never holds delays no other transfer."""
        engine = self.engine
        if not engine._still_expected(job.key):
            return  # the KV arrived (or decode gave up): nothing left to ask for
        try:
            reply = self.request(
                lambda n: Get(req_no=n, sender_addr=engine.addr, key=job.key,
                              skip_blocks=job.skip_blocks),
                job.deadline,
            )
        except TransportError as e:
            job.on_failure(str(e))
            return
        logger.debug("P2P %s: Get of %s answered %s", engine.addr, job.key, reply.status)
        if reply.status == Status.OK:
            # The offer follows on our listener; ask again if it has not
            # come by then (the answer says whether the send still runs).
            self._later_push(time.monotonic() + GET_CONFIRM_INTERVAL_S, job)
            return
        if reply.status != Status.NOT_READY:
            job.on_failure(f"prefill {self.addr} answered {reply.status} {reply.reason}")
            return
        retry_at = time.monotonic() + GET_RETRY_INTERVAL_S
        if retry_at > job.deadline:
            job.on_failure(f"prefill {self.addr} did not have the KV ready in time")
            return
        self._later_push(retry_at, job)

    def _later_push(self, when: float, job: _GetJob) -> None:
        if when < job.deadline:
            heapq.heappush(self._later, (when, next(self._later_no), job))

    def _ensure_channel(self, deadline: float) -> None:
        if self.channel is not None:
            return
        engine = self.engine
        setup, finish = engine.transport.initiate(peer_host=split_addr(self.addr)[0])
        channel_id = secrets.token_hex(8)
        reply = self.request(
            lambda n: Hello(
                version=proto.PROTOCOL_VERSION, req_no=n, sender_addr=engine.addr,
                channel_id=channel_id, transport=engine.transport.name, setup=setup,
                layout=engine.layout.spec, send_type=engine.send_type, sent_at=time.time(),
            ),
            deadline,
        )
        if reply.status != Status.OK:
            raise TransportError(f"peer {self.addr} refused the channel ({reply.reason}; "
                                 "its log says why)")
        self.channel = finish(reply.setup, deadline)
        self.channel_id = channel_id
        logger.info("P2P channel to %s is up (%s)", self.addr, engine.transport.name)

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = None

    def _send(self, xfer: SendTransfer) -> None:
        engine = self.engine
        start = time.monotonic()
        sent_bytes = 0
        try:
            for attempt in range(2):
                self._ensure_channel(xfer.deadline)
                reply = self.request(
                    lambda n: Offer(req_no=n, channel_id=self.channel_id, key=xfer.key,
                                    xfer_id=0, num_blocks=len(xfer.block_ids),
                                    prompt_digest=xfer.prompt_digest,
                                    request_id=xfer.request_id[:512]),
                    xfer.deadline,
                )
                if reply.status == Status.REJECTED and reply.reason == "unknown_channel":
                    # The receiver dropped its end of the channel (a receive of its
                    # failed after we had sent every byte): ours is useless, and kept
                    # it would get every later offer refused. Offer again on a new one.
                    self._close_channel()
                    if attempt == 0:
                        continue
                break
            logger.debug("P2P %s: offer of %s to %s answered %s after %.3f s", engine.addr,
                         xfer.key, self.addr, reply.status, time.monotonic() - start)
            if reply.status != Status.OK:
                engine._finish_send(xfer, ok=False, reason=f"{reply.status} {reply.reason}")
                return
            skip = reply.skip_blocks
            if skip >= len(xfer.block_ids):
                engine._finish_send(xfer, ok=False, reason=f"peer claimed skip={skip}")
                return
            blocks = xfer.block_ids[skip:]
            for layer in range(xfer.num_layers):
                xfer.wait_layer(layer)
                parts = engine.layout.read_blocks(layer, blocks)
                self.channel.send(parts, xfer.deadline)
                sent_bytes += sum(p.numel() for p in parts)
        except TransportError as e:
            self._close_channel()
            engine._finish_send(xfer, ok=False, reason=str(e))
            return
        engine.stats.record_send(sent_bytes, len(blocks), time.monotonic() - start)
        engine._finish_send(xfer, ok=True)


# --- the engine --------------------------------------------------------------


class P2pEngine:
    """One worker's end of the P2P KV transfer network (see the module docstring)."""

    def __init__(
        self,
        *,
        layout: KVLayout,
        host: str,
        port: int,
        transport: Transport,
        send_type: str,
        kv_buffer_size: int,
        mem_pool_size_bytes: int,
        hold_timeout_s: float,
        secret: bytes | None = None,
        stats: P2pStatsRecorder | None = None,
    ):
        self.layout = layout
        self.addr = format_addr(host, port)
        self.transport = transport
        self.send_type = send_type
        self.kv_buffer_size = kv_buffer_size
        self.mem_pool_size_bytes = mem_pool_size_bytes
        self.hold_timeout_s = hold_timeout_s
        self.secret = secret or None
        self.stats = stats or P2pStatsRecorder()
        transport.on_rejected = self.stats.record_rejected  # its data port counts here too
        self.stopped = threading.Event()
        self.zmq_ctx = zmq.Context()

        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._inbound: dict[str, _InboundChannel] = {}
        self._recv_threads = 0  # receive threads alive (at most MAX_INBOUND_CHANNELS)
        self._seen_channels: dict[str, float] = {}  # channel id -> forget after (replays)
        # Receive side: one explicit state per key (recv_state.py).
        self._recv = RecvTable(Timeouts(hold_s=hold_timeout_s, closed_s=TOMBSTONE_TTL_S))
        # GET, send side: one HoldState per key (HELD -> SENDING -> RELEASED).
        self._holds: dict[str, _Hold] = {}
        self._finished_sends: list[SendTransfer] = []
        self._buffer_used = 0
        self._pool: TensorMemoryPool | None = None
        self._limited_log = RateLimitedLog(logger, LOG_INTERVAL_S)

        self._router = self.zmq_ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        harden_listener(self._router, 2 * proto.MAX_FRAME_BYTES)
        if ":" in host:
            self._router.setsockopt(zmq.IPV6, 1)
        try:
            self._router.bind(zmq_endpoint(self.addr))
        except zmq.ZMQError as e:
            self._router.close(linger=0)
            self.zmq_ctx.term()
            raise OSError(
                f"P2pNcclConnector cannot listen on {self.addr} ({e}): the port is "
                "taken; every worker of every DP rank needs its own port "
                "(kv_port + dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank), "
                "so give each instance on a host a kv_port range of its own"
            ) from e
        self._listener = threading.Thread(target=self._listen, name="p2p-listener", daemon=True)
        self._listener.start()

    # --- model-thread API: sending ---

    def start_send(
        self, key: str, request_id: str, peer: str, block_ids: list[int], *,
        all_saved: bool, prompt_digest: bytes,
    ) -> SendTransfer:
        """Queue the KV of ``block_ids`` for ``peer``; layers follow via layer_saved()."""
        xfer = SendTransfer(
            key=key, request_id=request_id, peer=peer, block_ids=list(block_ids),
            num_layers=self.layout.num_layers,
            deadline=time.monotonic() + self.hold_timeout_s, prompt_digest=prompt_digest,
        )
        if all_saved:
            xfer.all_saved()
        self._submit(peer, xfer)
        return xfer

    def hold(
        self, key: str, request_id: str, block_ids: list[int], *, prompt_digest: bytes,
        decode_addr: str | None = None,
    ) -> SendTransfer:
        """GET mode: keep the KV of ``block_ids`` until a peer pulls it or the hold expires.

        A second hold of one key (a retried id) replaces the first, which
        ends as a failed send at once: nothing could ever pull it."""
        xfer = SendTransfer(
            key=key, request_id=request_id, peer="", block_ids=list(block_ids),
            num_layers=self.layout.num_layers,
            deadline=time.monotonic() + self.hold_timeout_s, prompt_digest=prompt_digest,
            decode_host=canonical_host(split_addr(decode_addr)[0]) if decode_addr else "",
        )
        xfer.all_saved()
        with self._lock:
            old = self._holds.get(key)
            self._holds[key] = _Hold(HoldState.HELD, xfer, xfer.deadline)
        # A transfer already being sent ends on its own; a held one never would.
        if old is not None and old.state is HoldState.HELD:
            self._finish_send(old.xfer, ok=False, reason="replaced by a second hold of its key")
        logger.debug("P2P %s: holding %d blocks of %s for a Get", self.addr, len(block_ids), key)
        return xfer

    def take_finished_sends(self) -> list[SendTransfer]:
        with self._lock:
            done, self._finished_sends = self._finished_sends, []
        return done

    # --- model-thread API: receiving ---

    def expect(
        self, key: str, skip_blocks: int, deadline: float, get_from: str | None,
        prompt_digest: bytes, prefill_addr: str | None = None,
    ) -> None:
        """Decode knows request ``key``: it holds ``skip_blocks`` leading blocks itself,
        and accepts KV only for the prompt whose digest is ``prompt_digest``.

        With ``get_from`` (GET mode) the prefill worker at that address is asked
        to offer the KV now."""
        with self._lock:
            entry = self._recv.apply(key, Event.EXPECT, time.monotonic(), deadline=deadline)
            entry.skip_blocks, entry.prompt_digest = skip_blocks, prompt_digest
            entry.load_deadline = deadline
            if prefill_addr:
                entry.prefill_host = canonical_host(split_addr(prefill_addr)[0])
            ask = get_from is not None and entry.state is RecvState.EXPECTED
        if ask:
            self._submit(get_from, _GetJob(
                key=key, skip_blocks=skip_blocks, deadline=deadline,
                on_failure=lambda reason: self._fail_expected(key, reason),
            ))

    def poll(self, key: str) -> RecvSlot | None:
        """The slot of ``key`` once it is complete or failed (then owned by the caller)."""
        with self._lock:
            entry = self._recv.get(key)
            if entry is None or entry.state is not RecvState.READY:
                return None
            self._recv.apply(key, Event.TAKEN, time.monotonic())
            slot, entry.slot = entry.slot, None
            return slot

    def copy_into_cache(self, slot: RecvSlot, block_ids: list[int], first_block: int) -> None:
        """Write blocks ``first_block..`` of the prompt from ``slot`` into ``block_ids``."""
        offset = first_block - slot.skip_blocks
        if offset < 0 or offset + len(block_ids) != slot.blocks_held:
            raise ValueError(
                f"received blocks {slot.skip_blocks}..{slot.num_blocks} do not cover "
                f"the {len(block_ids)} blocks from {first_block} this request needs"
            )
        pages = self.layout.page_bytes
        pending = False
        for i in range(slot.num_layers):
            data = slot.layer(i)[offset * pages :]
            pending |= self.layout.write_blocks(i, block_ids, data)
        if pending:
            # The source is a pinned pool block, freed (and free for the next
            # receive to overwrite) once the caller releases the slot: wait
            # until the copies queued on the current stream have read it.
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.layout.device))
            done.synchronize()

    def abandon(self, key: str) -> None:
        """The worker stops waiting for ``key``; its room is freed now, or when
        a receive in progress ends; a later offer is refused."""
        with self._lock:
            entry = self._recv.get(key)
            before = entry.state if entry is not None else None
            if not self._recv.allows(key, Event.ABANDON):  # every state allows it
                logger.error("P2P: abandon of %s in state %s", key, before)
                return
            entry = self._recv.apply(key, Event.ABANDON, time.monotonic())
            slot = None
            if before is RecvState.READY:
                slot, entry.slot = entry.slot, None
        if slot is not None:
            self.release(slot)

    def release(self, slot: RecvSlot) -> None:
        """Return a slot's bytes to the buffer budget or the pool."""
        with self._lock:
            if slot.pool_alloc is not None:
                self._pool.free(slot.pool_alloc)
                slot.pool_alloc = None
            else:
                self._buffer_used -= slot.nbytes
            slot.tensor = torch.empty(0, dtype=torch.uint8)
            self.stats.set_occupancy(self._buffer_used, self._pool_used())

    def occupancy(self) -> tuple[int, int]:
        """(receive buffer bytes, pool bytes) in use: for tests and metrics."""
        with self._lock:
            return self._buffer_used, self._pool_used()

    def close(self) -> None:
        self.stopped.set()
        self._listener.join(timeout=2)
        for peer in list(self._peers.values()):
            peer.thread.join(timeout=2)
        for inbound in list(self._inbound.values()):
            if inbound.channel is not None:
                inbound.channel.close()
        self.transport.close()
        self.zmq_ctx.term()

    # --- internals ---

    def _submit(self, addr: str, job: SendTransfer | _GetJob) -> None:
        """Queue ``job`` on the thread of peer ``addr`` (started if there is none).
        Under the lock, so a peer thread retiring at this moment cannot drop it.
        One thread (and channel) per peer whatever the spelling of its address."""
        addr = format_addr(*canonical_addr(addr))
        with self._lock:
            peer = self._peers.get(addr)
            if peer is None:
                peer = self._peers[addr] = _Peer(self, addr)
            peer.jobs.put(job)

    def _retire_peer(self, peer: _Peer) -> bool:
        """An idle peer thread asks to exit: yes unless a job arrived meanwhile."""
        with self._lock:
            if not peer.jobs.empty():
                return False
            if self._peers.get(peer.addr) is peer:
                del self._peers[peer.addr]
            return True

    def _pool_used(self) -> int:
        return self._pool.used_bytes if self._pool is not None else 0

    def _reject(self, kind: str, detail: str) -> None:
        self.stats.record_rejected(kind)
        self._log_limited(kind, f"P2P engine {self.addr} rejected a message ({kind}): {detail}")

    def _log_limited(self, kind: str, line: str) -> None:
        self._limited_log.warning(kind, "%s", line)

    def _finish_send(self, xfer: SendTransfer, *, ok: bool, reason: str = "") -> None:
        with self._lock:
            if xfer.finished:  # once: the sweep's backstop may race the send itself
                return
            xfer.finished = True
        xfer.ok, xfer.reason = ok, reason
        with self._lock:
            hold = self._holds.get(xfer.key)
            if hold is not None and hold.xfer is xfer and hold.state is HoldState.SENDING:
                hold.state = HoldState.RELEASED
                hold.until = time.monotonic() + TOMBSTONE_TTL_S
        if not ok:
            self.stats.record_failed_send()
            logger.warning("P2P send of %s to %s failed: %s", xfer.key, xfer.peer, reason)
        with self._lock:
            self._finished_sends.append(xfer)
        xfer.done.set()

    def _still_expected(self, key: str) -> bool:
        """Decode still waits for an offer of ``key`` (GET: keep asking)."""
        with self._lock:
            return self._recv.state(key) is RecvState.EXPECTED

    def _fail_expected(self, key: str, reason: str) -> None:
        self._fail_key(key, reason, only_expected=True)

    def _fail_key(self, key: str, reason: str, *, only_expected: bool = False) -> None:
        """No KV will come for ``key`` (no room, another prompt's, the GET
        failed): the worker's poll() gets the reason at once, or as soon as
        decode expects the key; swept if it never does."""
        with self._lock:
            state = self._recv.state(key)
            if state not in (None, RecvState.EXPECTED) or (only_expected and state is None):
                return
            entry = self._recv.apply(key, Event.FAILED, time.monotonic())
            entry.reason = reason
            entry.slot = RecvSlot(
                key=key, num_blocks=0, skip_blocks=0, page_bytes=0, num_layers=0,
                tensor=torch.empty(0, dtype=torch.uint8), pool_alloc=None,
                deadline=0.0, state=SlotState.FAILED, reason=reason,
            )

    def _finish_slot(self, slot: RecvSlot, *, ok: bool, reason: str = "") -> None:
        """The receive of ``slot`` ended (its thread, or its channel's drain)."""
        with self._lock:
            slot.state = SlotState.COMPLETE if ok else SlotState.FAILED
            slot.reason = reason
            entry = self._recv.get(slot.key)
            free = entry is None or entry.slot is not slot
            if not free:
                before = entry.state
                self._recv.apply(slot.key, Event.RECEIVED if ok else Event.FAILED,
                                 time.monotonic())  # fmt: skip
                if before is RecvState.ABANDONING:
                    entry.slot, free = None, True
        if not ok:
            logger.warning("P2P receive of %s failed: %s", slot.key, reason)
        if free:
            self.release(slot)

    def _recv_layer(self, channel: Channel, slot: RecvSlot, layer: int) -> None:
        dst = slot.layer(layer)
        if slot.pool_alloc is not None and not self.transport.receives_into_host:
            staging = torch.empty(dst.numel(), dtype=torch.uint8, device=self.layout.device)
            channel.recv([staging], slot.deadline)
            dst.copy_(staging)
        else:
            channel.recv([dst], slot.deadline)

    def _allocate(self, nbytes: int) -> tuple[torch.Tensor, PoolAllocation | None] | None:
        """Room for ``nbytes``: receive buffer first, then the pool; None if neither."""
        with self._lock:
            if self._buffer_used + nbytes <= self.kv_buffer_size:
                self._buffer_used += nbytes
                tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.layout.device)
                self.stats.set_occupancy(self._buffer_used, self._pool_used())
                return tensor, None
            if self.mem_pool_size_bytes > 0:
                if self._pool is None:
                    self._pool = TensorMemoryPool(self.mem_pool_size_bytes)
                alloc = self._pool.allocate(nbytes)
                if alloc is not None:
                    self.stats.record_spill()
                    self.stats.set_occupancy(self._buffer_used, self._pool_used())
                    return alloc.tensor, alloc
        return None

    # the listener thread

    def _listen(self) -> None:
        router = self._router
        last_sweep = time.monotonic()
        while not self.stopped.is_set():
            if router.poll(int(POLL_INTERVAL_S * 1000)):
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                if len(frames) < 2:
                    continue
                source = _source_ip(frames[1])
                route, body = frames[0].bytes, [f.bytes for f in frames[1:]]
                msg = None
                try:
                    msg = proto.open_frame(self.secret, body)
                    reply = self._handle(msg, route, source)
                except proto.FrameError as e:
                    self._reject(e.kind, str(e))
                    continue
                except Exception:  # noqa: BLE001 - one bad message must not stop the listener
                    logger.exception("P2P listener failed to handle a message")
                    reply = Reply(req_no=getattr(msg, "req_no", 0), status=Status.REJECTED,
                                  reason="internal")
                if reply is not None:
                    router.send_multipart([route, *proto.seal(self.secret, reply)])
            now = time.monotonic()
            if now - last_sweep > 0.2:
                last_sweep = now
                self._sweep(now)
        router.close(linger=0)

    def _handle(self, msg, route: bytes = b"", source: str | None = None) -> Reply | None:
        if isinstance(msg, (Hello, Get)) and source is not None:
            # The address a Hello or Get names for replies and data must be
            # the machine it came from: a peer cannot send this side's data
            # connections or pulled KV to a third one.
            try:
                named = canonical_host(split_addr(msg.sender_addr, "sender_addr")[0])
                foreign = source not in addresses_of(named)
            except (PeerInfoError, TransportError) as e:
                return self._refuse(msg.req_no, "malformed", f"{type(msg).__name__}: {e}")
            if foreign:
                return self._refuse(msg.req_no, "address",
                                    f"{type(msg).__name__} from {source} names {msg.sender_addr}")
        if isinstance(msg, Hello):
            return self._on_hello(msg, route)
        if isinstance(msg, Offer):
            return self._on_offer(msg, route)
        if isinstance(msg, Get):
            return self._on_get(msg)
        self._reject("unexpected", f"{type(msg).__name__} on the listener")
        return None

    def _refuse(self, req_no: int, kind: str, reason: str) -> Reply:
        """Refuse with the kind only: the details (the local layout, say) go
        to this side's log, never to a peer that may be a stranger."""
        self._reject(kind, reason)
        return Reply(req_no=req_no, status=Status.REJECTED, reason=kind)

    def _on_hello(self, msg: Hello, route: bytes = b"") -> Reply:
        if msg.version != proto.PROTOCOL_VERSION:
            return self._refuse(msg.req_no, "version",
                                f"protocol version {msg.version}, expected {proto.PROTOCOL_VERSION}")
        if msg.transport != self.transport.name:
            return self._refuse(msg.req_no, "transport",
                                f"peer uses transport {msg.transport}, this worker {self.transport.name}")
        mismatch = check_compatible(self.layout.spec, msg.layout)
        if mismatch:
            return self._refuse(msg.req_no, "layout", mismatch)
        if msg.send_type != self.send_type:
            return self._refuse(msg.req_no, "send_type",
                                f"peer uses send_type {msg.send_type}, this worker {self.send_type}")
        skew = time.time() - msg.sent_at
        if abs(skew) > MAX_HELLO_AGE_S:
            return self._refuse(msg.req_no, "stale", f"Hello sent {skew:.0f} s ago (clock skew "
                                f"or a replay; at most {MAX_HELLO_AGE_S:.0f} s)")
        with self._lock:
            if msg.channel_id in self._inbound or msg.channel_id in self._seen_channels:
                return self._refuse(msg.req_no, "duplicate", "channel id in use or replayed")
            # Threads, not channels: a replaced channel's thread may still be
            # waiting for its set-up to time out.
            if self._recv_threads >= MAX_INBOUND_CHANNELS:
                return self._refuse(msg.req_no, "busy",
                                    f"{MAX_INBOUND_CHANNELS} receive threads already running")
        try:
            reply_setup, finish = self.transport.accept(
                msg.setup, peer_host=split_addr(msg.sender_addr, "sender_addr")[0]
            )
        except (TransportError, PeerInfoError) as e:
            return self._refuse(msg.req_no, "malformed", f"bad channel set-up: {e}")
        now = time.monotonic()
        with self._lock:
            self._recv_threads += 1
            self._seen_channels[msg.channel_id] = now + 2 * MAX_HELLO_AGE_S
        inbound = _InboundChannel(self, msg.channel_id, msg.sender_addr, finish,
                                  now + min(self.hold_timeout_s, CHANNEL_SETUP_TIMEOUT_S),
                                  route=route)  # fmt: skip
        with self._lock:
            self._inbound[msg.channel_id] = inbound
        return Reply(req_no=msg.req_no, status=Status.OK, setup=reply_setup)

    def _on_offer(self, msg: Offer, route: bytes = b"") -> Reply:
        with self._lock:
            inbound = self._inbound.get(msg.channel_id)
            if inbound is not None and inbound.route != route:
                inbound = None  # another connection's channel: not this sender's to use
            # Keys nobody asked for are remembered (a refusal, a slot) only up
            # to a bound: a flood of offers must not grow the table.
            busy = msg.key not in self._recv.keys and len(self._recv.keys) >= MAX_RECV_KEYS
            entry = self._recv.get(msg.key)
            state = entry.state if entry is not None else None
            exp = entry if entry is not None and entry.expected else None
            duplicate = state in (RecvState.RECEIVING, RecvState.ABANDONING, RecvState.READY)
            gave_up = state is RecvState.CLOSED
        if inbound is None or inbound.broken:
            return self._refuse(msg.req_no, "unknown_channel", f"offer on unknown channel {msg.channel_id!r}")
        if msg.num_blocks > self.layout.num_blocks:
            return self._refuse(msg.req_no, "oversized",
                                f"offer of {msg.num_blocks} blocks, the KV cache has {self.layout.num_blocks}")
        if duplicate:
            return self._refuse(msg.req_no, "duplicate", f"second offer for {msg.key}")
        if busy:
            return self._refuse(msg.req_no, "busy", f"{MAX_RECV_KEYS} keys already tracked")
        if gave_up:
            return Reply(req_no=msg.req_no, status=Status.NOT_WANTED)
        if exp is not None and msg.prompt_digest != exp.prompt_digest:
            # KV of another prompt under this key: never filed. From the host
            # of the prefill the request named, no other KV will come: fail
            # the load now; from anyone else, only refuse (the real one may).
            self.stats.record_digest_mismatch()
            if exp.prefill_host and canonical_host(split_addr(inbound.peer)[0]) == exp.prefill_host:
                self._fail_key(msg.key, "offered KV belongs to another prompt (digest mismatch)")
            return self._refuse(msg.req_no, "digest", f"offer of {msg.key}: prompt digest "
                                "differs from the request's")
        skip = min(exp.skip_blocks, msg.num_blocks - 1) if exp is not None else 0
        deadline = exp.load_deadline if exp is not None else time.monotonic() + self.hold_timeout_s
        nbytes = self.layout.num_layers * (msg.num_blocks - skip) * self.layout.page_bytes
        room = self._allocate(nbytes)
        if room is None:
            # Not a bad message: counted as dropped only. The load fails now
            # (or as soon as decode expects the key), not at its deadline.
            self.stats.record_dropped()
            self._fail_key(msg.key, f"no room for {nbytes} bytes: receive buffer and pool are full")
            self._log_limited("no_space", f"P2P engine {self.addr} dropped the KV of {msg.key}: "
                              f"no room for {nbytes} bytes in the receive buffer or the pool; "
                              "the request will be recomputed")
            return Reply(req_no=msg.req_no, status=Status.NO_SPACE)
        tensor, alloc = room
        slot = RecvSlot(
            key=msg.key, num_blocks=msg.num_blocks, skip_blocks=skip,
            page_bytes=self.layout.page_bytes, num_layers=self.layout.num_layers,
            tensor=tensor, pool_alloc=alloc, deadline=deadline,
            prompt_digest=msg.prompt_digest,
        )
        with self._lock:
            # The worker may have given up on the key while the room was taken,
            # or the channel may have broken: its drain runs under this lock
            # too, so a slot queued here is either received or failed, never stuck.
            gave_up = not self._recv.allows(msg.key, Event.OFFER)
            broken = inbound.broken
            if not gave_up and not broken:
                entry = self._recv.apply(msg.key, Event.OFFER, time.monotonic(), deadline=deadline)
                entry.slot = slot
                inbound.queue.put(slot)
        if gave_up or broken:
            self.release(slot)
            if broken:
                return self._refuse(msg.req_no, "unknown_channel",
                                    f"offer on closed channel {msg.channel_id!r}")
            return Reply(req_no=msg.req_no, status=Status.NOT_WANTED)
        return Reply(req_no=msg.req_no, status=Status.OK, skip_blocks=skip)

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
            return self._refuse(msg.req_no, "not_yours", f"Get of {msg.key} from "
                                f"{msg.sender_addr}: held for {hold.xfer.decode_host}")
        logger.debug("P2P %s: Get of %s from %s: %s", self.addr, msg.key, msg.sender_addr,
                     "held" if xfer else "released" if released else "not held yet")
        if sending:  # decode asks again while its offer is on the way
            return Reply(req_no=msg.req_no, status=Status.OK)
        if xfer is None:
            return Reply(req_no=msg.req_no, status=Status.GONE if released else Status.NOT_READY)
        xfer.peer = msg.sender_addr
        self._submit(msg.sender_addr, xfer)
        return Reply(req_no=msg.req_no, status=Status.OK)

    def _sweep(self, now: float) -> None:
        """Expire holds nobody pulled, receive-side keys past their deadline
        (unclaimed slots freed), and old released keys."""
        expired_holds = []
        with self._lock:
            for cid, until in list(self._seen_channels.items()):
                if now > until:
                    del self._seen_channels[cid]
            for key, hold in list(self._holds.items()):
                if now <= hold.until:
                    continue
                if hold.state is HoldState.HELD:  # nobody pulled it
                    hold.state, hold.until = HoldState.RELEASED, now + TOMBSTONE_TTL_S
                    expired_holds.append(hold.xfer)
                elif hold.state is HoldState.RELEASED:
                    del self._holds[key]
                else:  # SENDING past its send's deadline: end it if its send did not
                    hold.state, hold.until = HoldState.RELEASED, now + TOMBSTONE_TTL_S
                    expired_holds.append(hold.xfer)
            expired = self._recv.expire(now)
            orphans = []
            for entry in expired:
                if entry.slot is not None:
                    orphans.append((entry.expected, entry.slot))
                    entry.slot = None
        for xfer in expired_holds:
            self._finish_send(xfer, ok=False, reason="not pulled and sent before kv_hold_timeout_s")
        for expected, slot in orphans:
            if not expected:
                logger.warning("P2P: freeing KV of %s that no request claimed", slot.key)
            self.release(slot)
