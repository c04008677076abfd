"""The thread that does everything this side asks of one peer worker.

It runs one job at a time, in order: a send (Hello on first contact, Offer,
then the layers in data messages of one or more layers each,
``protocol.layer_groups``, on the channel it created) or a GET's ``Get``;
"not ready" answers wait in a retry heap, not in the thread, so other jobs go
first. A peer that leaves a request unanswered is not asked again for
``PEER_RETRY_AFTER_S``; an idle thread retires after ``PEER_IDLE_S`` (limits.py).
The thread talks to the engine only through :class:`~.ports.PeerOwner`.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import secrets
import threading
import time
from collections.abc import Callable

import zmq

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import limits
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.placement import (
    place_current_thread,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.ports import (
    PeerOwner,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    GetJob,
    SendTransfer,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    MAX_ABORT_KEYS,
    MAX_REASON_CHARS,
    Abort,
    Get,
    Offer,
    Refusal,
    Reply,
    Status,
    refusal,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
    TransportError,
)
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.peers import split_addr

# One logger for the engine package, named as the module it was split from.
logger = init_logger(__package__)


def zmq_endpoint(addr: str) -> str:
    return f"tcp://{addr}"


class Peer:
    """Everything we send to one peer worker: control requests and data, in order."""

    def __init__(self, owner: PeerOwner, addr: str):
        self.owner = owner
        self.addr = addr
        self.jobs: queue.Queue[SendTransfer | GetJob] = queue.Queue()
        self.channel: Channel | None = None
        self.channel_id = ""
        self._sock: zmq.Socket | None = None
        self._req_no = itertools.count(1)
        # GET jobs answered "not ready", each with the time to ask again:
        # they wait here, not in the thread, so other transfers go first.
        self._later: list[tuple[float, int, GetJob]] = []
        self._later_no = itertools.count()
        self.silent_until = (
            0.0  # the peer left a request unanswered: fail fast until then
        )
        # Sends this side gave up on, to tell the receiver (Abort): key ->
        # (the transfer's deadline, why); re-sent until answered or past it.
        self._aborts: dict[str, tuple[float, str]] = {}
        self._abort_retry_at = 0.0
        self._in_job = False
        self.thread = threading.Thread(
            target=self._run, name=f"p2p-peer-{addr}", daemon=True
        )
        self.thread.start()

    # control requests

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self.owner.zmq_ctx.socket(zmq.DEALER)
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

    def request(
        self, make_msg: Callable[[int], proto.Message], deadline: float
    ) -> Reply:
        """Send a control message and wait for its Reply until ``deadline``, at
        most CONTROL_REPLY_TIMEOUT_S; a peer that does not answer is not asked
        again for PEER_RETRY_AFTER_S."""
        deadline = min(deadline, time.monotonic() + limits.CONTROL_REPLY_TIMEOUT_S)
        req_no = next(self._req_no)
        sock = self._socket()
        msg = make_msg(req_no)
        sock.send_multipart(proto.seal(self.owner.secret, msg))
        sent_at = time.monotonic()
        while True:
            now = time.monotonic()
            left_ms = int((deadline - now) * 1000)
            if left_ms <= 0 or self.owner.stopped.is_set():
                self._reset_socket()
                self.silent_until = now + limits.PEER_RETRY_AFTER_S
                raise TransportError(
                    f"no reply to {type(msg).__name__} from {self.addr} in "
                    f"{now - sent_at:.1f} s"
                )
            if not sock.poll(min(left_ms, 100)):
                continue
            frames = sock.recv_multipart()
            try:
                msg = proto.open_frame(self.owner.secret, frames)
            except proto.FrameError as e:
                self.owner.reject(e.kind, f"from {self.addr}: {e}")
                continue
            if isinstance(msg, Reply) and msg.req_no == req_no:
                return msg
            # A late reply to an earlier request: ignore.

    # the thread

    def _run(self) -> None:
        # Started from the model thread, whose core vLLM may have pinned.
        place_current_thread()
        owner = self.owner
        idle_since = time.monotonic()
        while not owner.stopped.is_set():
            now = time.monotonic()
            wait = limits.POLL_INTERVAL_S
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
            if self._aborts:
                self._flush_aborts()
            if job is not None or self._later or self._aborts:
                idle_since = now
            elif now - idle_since > limits.PEER_IDLE_S and owner.retire_peer(self):
                break
        self._reset_socket()
        if self.channel is not None:
            self.channel.close()

    def busy(self) -> bool:
        """A job under way or queued, or an Abort not yet answered (read by
        the engine's close from another thread: a hint, not a lock)."""
        return self._in_job or not self.jobs.empty() or bool(self._aborts)

    def _do(self, job: SendTransfer | GetJob) -> None:
        self._in_job = True
        try:
            self._do_job(job)
        finally:
            self._in_job = False

    def _do_job(self, job: SendTransfer | GetJob) -> None:
        if self.owner.closing.is_set():
            reason = "the engine is closing"
            if isinstance(job, GetJob):
                job.on_failure(reason)
            else:
                self._give_up(job, reason)
            return
        if isinstance(job, SendTransfer) and job.abandoned:
            self._give_up(job, job.abandoned)  # no Offer for KV that will not come
            return
        left = self.silent_until - time.monotonic()
        if left > 0:
            reason = (
                f"peer {self.addr} left a request unanswered; not asked again for "
                f"{left:.1f} s"
            )
            if isinstance(job, GetJob):
                job.on_failure(reason)
            else:
                self._give_up(job, reason)
            return
        try:
            if isinstance(job, GetJob):
                self._get(job)
            else:
                self._send(job)
        except Exception as e:  # noqa: BLE001 - a job's bug must not kill the peer's thread
            logger.exception("P2P peer thread %s: a job failed", self.addr)
            if isinstance(job, GetJob):
                job.on_failure(f"internal error: {e}")
            elif not job.done.is_set():
                self._give_up(job, f"internal error: {e}")

    # giving up on a send, and saying so

    def _give_up(self, xfer: SendTransfer, reason: str) -> None:
        """The send of ``xfer`` failed: end it, and tell the receiver, which
        would otherwise wait for this KV until its kv_load_timeout_s."""
        self.owner.finish_send(xfer, ok=False, reason=reason)
        self._aborts[xfer.key] = (xfer.deadline, reason)
        self._abort_retry_at = 0.0  # at once, even if the peer went silent

    def _flush_aborts(self) -> None:
        """Send one Abort for the oldest pending keys; on no answer, ask again
        after PEER_RETRY_AFTER_S until their transfers' deadlines pass."""
        now = time.monotonic()
        for key, (until, _) in list(self._aborts.items()):
            if now > until:
                del self._aborts[key]
        if not self._aborts or now < self._abort_retry_at:
            return
        keys = list(self._aborts)[:MAX_ABORT_KEYS]
        reason = self._aborts[keys[0]][1][:MAX_REASON_CHARS]
        try:
            self.request(
                lambda n: Abort(req_no=n, keys=keys, reason=reason),
                now + limits.ABORT_REPLY_TIMEOUT_S,
            )
        except TransportError as e:
            self._abort_retry_at = time.monotonic() + limits.PEER_RETRY_AFTER_S
            logger.debug("P2P abort of %d keys to %s: %s", len(keys), self.addr, e)
            return
        for key in keys:
            self._aborts.pop(key, None)

    def _get(self, job: GetJob) -> None:
        """Ask once; a "not ready" answer puts the job back with a retry time,
        so a key the prefill never holds delays no other transfer."""
        owner = self.owner
        if not owner.still_expected(job.key):
            return  # the KV arrived (or decode gave up): nothing left to ask for
        try:
            reply = self.request(
                lambda n: Get(
                    req_no=n,
                    sender_addr=owner.local.addr,
                    key=job.key,
                    skip_blocks=job.skip_blocks,
                ),
                job.deadline,
            )
        except TransportError as e:
            job.on_failure(str(e))
            return
        logger.debug(
            "P2P %s: Get of %s answered %s", owner.local.addr, job.key, reply.status
        )
        if reply.status == Status.OK:
            # The offer follows on our listener; ask again if it has not
            # come by then (the answer says whether the send still runs).
            self._later_push(time.monotonic() + limits.GET_CONFIRM_INTERVAL_S, job)
            return
        if reply.status != Status.NOT_READY:
            job.on_failure(
                f"prefill {self.addr} answered {reply.status} {reply.reason}"
            )
            return
        retry_at = time.monotonic() + limits.GET_RETRY_INTERVAL_S
        if retry_at > job.deadline:
            job.on_failure(f"prefill {self.addr} did not have the KV ready in time")
            return
        self._later_push(retry_at, job)

    def _later_push(self, when: float, job: GetJob) -> None:
        if when < job.deadline:
            heapq.heappush(self._later, (when, next(self._later_no), job))

    def _ensure_channel(self, deadline: float) -> None:
        if self.channel is not None:
            return
        owner = self.owner
        setup, finish = owner.local.transport.initiate(
            peer_host=split_addr(self.addr)[0]
        )
        channel_id = secrets.token_hex(8)
        reply = self.request(
            lambda n: owner.local.hello(n, channel_id, setup), deadline
        )
        if reply.status != Status.OK:
            raise TransportError(
                f"peer {self.addr} refused the channel ({reply.reason}; its log says "
                "why)"
            )
        self.channel = finish(reply.setup, deadline)
        self.channel_id = channel_id
        logger.info(
            "P2P channel to %s is up (%s)", self.addr, owner.local.transport.name
        )

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = None

    def _send(self, xfer: SendTransfer) -> None:
        owner = self.owner
        start = time.monotonic()
        sent_bytes = 0
        try:
            for attempt in range(2):
                self._ensure_channel(xfer.deadline)
                reply = self.request(
                    lambda n: Offer(
                        req_no=n,
                        channel_id=self.channel_id,
                        key=xfer.key,
                        num_blocks=len(xfer.block_ids),
                        prompt_digest=xfer.prompt_digest,
                        request_id=xfer.request_id[:512],
                    ),
                    xfer.deadline,
                )
                if refusal(reply) is Refusal.UNKNOWN_CHANNEL:
                    # The receiver dropped its end of the channel (a receive of its
                    # failed after we had sent every byte): ours is useless, and kept
                    # it would get every later offer refused. Offer again on a new one.
                    self._close_channel()
                    if attempt == 0:
                        continue
                break
            logger.debug(
                "P2P %s: offer of %s to %s answered %s after %.3f s",
                owner.local.addr,
                xfer.key,
                self.addr,
                reply.status,
                time.monotonic() - start,
            )
            if reply.status in (Status.NO_SPACE, Status.NOT_WANTED):
                # The receiver knows: it failed the load itself, or gave up.
                owner.finish_send(
                    xfer, ok=False, reason=f"{reply.status} {reply.reason}"
                )
                return
            if reply.status != Status.OK:
                self._give_up(xfer, f"{reply.status} {reply.reason}")
                return
            skip = reply.skip_blocks
            if skip >= len(xfer.block_ids):
                self._give_up(xfer, f"peer claimed skip={skip}")
                return
            blocks = xfer.block_ids[skip:]
            layout, checksum = owner.local.layout, owner.local.checksum
            page_bytes = layout.page_bytes
            read = (
                layout.read_block_bytes
                if owner.local.transport.sends_host_bytes
                and layout.blocks_contiguous
                and layout.device.type == "cpu"
                else layout.read_blocks
            )
            # One message per run of layers (proto.layer_groups), each layer
            # read as soon as it is saved, the run sent once its last is.
            for group in proto.layer_groups(xfer.num_layers, len(blocks) * page_bytes):
                message = []
                for layer in group:
                    xfer.wait_layer(layer)
                    parts = read(layer, blocks)
                    sent_bytes += sum(p.nbytes for p in parts)
                    message += parts
                    if checksum is not None:
                        # Over the very views handed to the transport: what the
                        # receiver checks is what left this side's KV cache.
                        message.append(checksum.digests(parts, page_bytes))
                self.channel.send(message, xfer.deadline)
        except TransportError as e:
            self._close_channel()
            self._give_up(xfer, str(e))
            return
        owner.stats.record_send(sent_bytes, len(blocks), time.monotonic() - start)
        owner.finish_send(xfer, ok=True)
