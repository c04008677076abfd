"""Step-synchronized data parallelism: the Coordinator/Participant protocol.

MoE DP ranks must run the same number of forward passes, because every pass
meets the other ranks in collectives. Instead of upstream's "waves" (a DP
coordinator process, START_DP_WAVE broadcasts, an all-reduce every N steps),
the ranks agree on a *coordinator step* ``G``: every rank runs forward passes
1..G, with dummy batches where it has no work of its own.

* One :class:`Coordinator` (a thread in DP rank 0's engine process) keeps
  ``G`` and the set of registered participants.
* One :class:`Participant` per DP rank. Its engine thread counts
  ``local_step`` (real or dummy forward passes done) and knows the latest
  ``coord_step`` granted. A rank with work that is about to run pass ``s``
  makes sure ``G >= s`` by asking for ``s + lookahead`` *before* it needs it
  (pipelined lease renewal: the request goes out while granted steps remain,
  so the round trip never stalls a step). Ranks with ``local_step < G`` run
  dummy passes; at most ``lookahead`` are wasted after the last work drains.

Wire: one ZMQ ROUTER (coordinator) and one DEALER per participant, msgspec
messages, every size bounded; malformed or foreign messages are dropped and
counted. Both sides exchange heartbeats; silence longer than
``peer_timeout_s`` is reported through ``on_failure`` so engines fail fast
instead of hanging in a collective.

Threading: the network side runs in one background thread per object. The
engine-side state of a participant (``local_step``, ``coord_step``) is only
touched by the engine thread: grants reach it through the ``on_grant``
callback, which the engine turns into an item on its input queue (waking it
if it is blocked) and hands back via :meth:`Participant.observe_grant`.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger

logger = init_logger(__name__)

# No legitimate message is anywhere near this; ZMQ drops larger frames.
MAX_MESSAGE_BYTES = 1024
# Heartbeats per peer_timeout_s; a peer must miss several before it is dead.
HEARTBEATS_PER_TIMEOUT = 5
# Longest the engine thread waits for a grant it asked for (see
# Participant._await_grant). Normally one loopback round trip, well under 1 ms.
MAX_GRANT_WAIT_S = 0.02


# --additional-config key -> StepSyncConfig field.
OPTION_KEYS = {
    "step_sync_lookahead": "lookahead",
    "step_sync_peer_timeout_s": "peer_timeout_s",
}


@dataclass(frozen=True)
class StepSyncConfig:
    dp_size: int
    lookahead: int = 2
    peer_timeout_s: float = 30.0

    def __post_init__(self):
        if not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ConfigError(f"step sync: dp_size must be an integer >= 1, got {self.dp_size!r}")
        if not isinstance(self.lookahead, int) or not 1 <= self.lookahead <= 1024:
            raise ConfigError(
                f"step_sync_lookahead must be an integer in [1, 1024], got {self.lookahead!r}"
            )
        timeout = self.peer_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            0.1 <= timeout <= 3600
        ):
            raise ConfigError(
                "step_sync_peer_timeout_s must be a number of seconds in [0.1, 3600], "
                f"got {self.peer_timeout_s!r}"
            )

    @classmethod
    def from_additional_config(cls, additional_config: object, dp_size: int) -> StepSyncConfig:
        """Read the engine options from ``--additional-config`` (JSON)."""
        options = additional_config if isinstance(additional_config, dict) else {}
        unknown = sorted(k for k in options if k.startswith("step_sync") and k not in OPTION_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown --additional-config key {unknown[0]!r}; "
                f"step sync options are {', '.join(OPTION_KEYS)}"
            )
        kwargs = {field: options[key] for key, field in OPTION_KEYS.items() if key in options}
        return cls(dp_size, **kwargs)

    @property
    def heartbeat_interval_s(self) -> float:
        return self.peer_timeout_s / HEARTBEATS_PER_TIMEOUT

    @property
    def renew_margin(self) -> int:
        """Renew the lease when fewer than this many granted steps remain."""
        return (self.lookahead + 1) // 2


# --- wire messages -----------------------------------------------------------


class Register(msgspec.Struct, tag="reg", array_like=True, forbid_unknown_fields=True):
    dp_rank: int
    dp_size: int
    lookahead: int
    incarnation: str


class RequestSteps(msgspec.Struct, tag="req", array_like=True, forbid_unknown_fields=True):
    """Participant -> coordinator: make sure every rank runs through ``step``."""

    dp_rank: int
    step: int


class Heartbeat(msgspec.Struct, tag="hb", array_like=True, forbid_unknown_fields=True):
    dp_rank: int
    local_step: int


class Grant(msgspec.Struct, tag="grant", array_like=True, forbid_unknown_fields=True):
    """Coordinator -> participant: every rank runs forward passes 1..``step``.
    Also sent unchanged as the coordinator's heartbeat."""

    step: int


class Abort(msgspec.Struct, tag="abort", array_like=True, forbid_unknown_fields=True):
    reason: str


class Pause(msgspec.Struct, tag="pause", array_like=True, forbid_unknown_fields=True):
    """Participant -> coordinator: this rank is paused and has no real work
    left, so it will ask for no more steps until it resumes."""

    dp_rank: int


class Resume(msgspec.Struct, tag="resume", array_like=True, forbid_unknown_fields=True):
    dp_rank: int


class GroupPaused(msgspec.Struct, tag="paused", array_like=True, forbid_unknown_fields=True):
    """Coordinator -> participants: every rank paused; all stop at ``step``."""

    step: int


class GroupResumed(msgspec.Struct, tag="resumed", array_like=True, forbid_unknown_fields=True):
    """Coordinator -> participants: every rank resumed; schedule again."""


ToCoordinator = Register | RequestSteps | Heartbeat | Pause | Resume
ToParticipant = Grant | Abort | GroupPaused | GroupResumed
PhaseEvent = GroupPaused | GroupResumed

_encoder = msgspec.msgpack.Encoder()
_to_coordinator = msgspec.msgpack.Decoder(ToCoordinator)
_to_participant = msgspec.msgpack.Decoder(ToParticipant)


@dataclass
class _PeerState:
    identity: bytes
    incarnation: str
    last_seen: float
    local_step: int = 0


class _Counters:
    """Thread-safe counters exported as metrics."""

    def __init__(self, *names: str):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def inc(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._values[name] += by

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


def _new_context_socket(kind: int) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return ctx, sock


class _NetworkThread:
    """What both roles share: one background thread that owns the sockets,
    a stop flag, and a failure reported at most once."""

    def __init__(self, thread_name: str, on_failure: Callable[[str], None]):
        self.on_failure = on_failure
        self._stop = threading.Event()
        self._failed: str | None = None
        self._sockets: list[zmq.Socket] = []
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        for sock in self._sockets:
            sock.close(linger=0)

    def _fail_once(self, reason: str, log_prefix: str) -> bool:
        """Log and report ``reason`` unless a failure was already reported."""
        if self._failed is not None:
            return False
        self._failed = reason
        logger.error("%s: %s", log_prefix, reason)
        self.on_failure(reason)
        return True


# --- coordinator -------------------------------------------------------------


class Coordinator(_NetworkThread):
    """Keeps the coordinator step and tells every participant when it grows.

    Runs a background thread bound to ``address`` (a ZMQ endpoint such as
    ``tcp://127.0.0.1:5555``; port 0 picks a free port, see :attr:`address`).
    """

    def __init__(
        self,
        config: StepSyncConfig,
        address: str,
        on_failure: Callable[[str], None] | None = None,
    ):
        super().__init__("StepSyncCoordinator", on_failure or (lambda reason: None))
        self.config = config
        self.step = 0
        self.counters = _Counters(
            "grants_sent", "requests_received", "malformed_messages", "pause_violations"
        )
        # Pause is a phase of the whole group: ranks that reported Pause, and
        # whether all of them did (then nobody may extend the step).
        self._paused_ranks: set[int] = set()
        self._group_paused = False
        self._resumed_ranks: set[int] = set()
        self._peers: dict[int, _PeerState] = {}
        # Rebuilt (never mutated) on registration, so other threads can read it.
        self._registered: tuple[int, ...] = ()
        _, self._sock = _new_context_socket(zmq.ROUTER)
        self._sockets.append(self._sock)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if address.endswith(":0"):
            port = self._sock.bind_to_random_port(address.rsplit(":", 1)[0])
            address = f"{address.rsplit(':', 1)[0]}:{port}"
        else:
            self._sock.bind(address)
        self.address = address

    @property
    def registered(self) -> list[int]:
        return list(self._registered)

    @property
    def stats(self) -> dict[str, int]:
        return {**self.counters.snapshot(), "coordinator_step": self.step}

    # The thread owns the socket from here on.
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        interval = self.config.heartbeat_interval_s
        next_heartbeat = time.monotonic() + interval
        while not self._stop.is_set():
            timeout_ms = max(0, int((next_heartbeat - time.monotonic()) * 1000))
            if poller.poll(min(timeout_ms, 100)):
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
            now = time.monotonic()
            if now >= next_heartbeat:
                next_heartbeat = now + interval
                self._broadcast(Grant(self.step))
                self._check_peers(now)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.counters.inc("malformed_messages")
            return
        identity, payload = frames
        try:
            msg = _to_coordinator.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._reject("undecodable message")
            return
        rank = msg.dp_rank
        if not 0 <= rank < self.config.dp_size:
            self._reject(f"dp_rank {rank} outside [0, {self.config.dp_size})")
            return
        if isinstance(msg, Register):
            self._register(identity, msg)
            return
        peer = self._peers.get(rank)
        if peer is None or peer.identity != identity:
            self._reject(f"message from unregistered rank {rank}")
            return
        peer.last_seen = time.monotonic()
        if isinstance(msg, Heartbeat):
            peer.local_step = max(peer.local_step, msg.local_step)
            return
        if isinstance(msg, Pause | Resume):
            self._pause_phase(identity, msg)
            return
        # RequestSteps: a participant runs at most one pass past what it knows
        # to be granted, and asks for `lookahead` past that pass.
        self.counters.inc("requests_received")
        if not 0 < msg.step <= self.step + self.config.lookahead + 1:
            self._reject(f"rank {rank} asked for step {msg.step} at coordinator step {self.step}")
            return
        if msg.step > self.step:
            if self._group_paused or rank in self._paused_ranks:
                # A paused rank promised no more work. Granting keeps the group
                # out of a collective deadlock; the count makes the bug visible.
                self.counters.inc("pause_violations")
                logger.warning("step sync: paused rank %d asked for step %d", rank, msg.step)
            self.step = msg.step
            logger.debug("step sync: rank %d extended coordinator step to %d", rank, self.step)
            self._broadcast(Grant(self.step))

    def _pause_phase(self, identity: bytes, msg: Pause | Resume) -> None:
        rank, dp_size = msg.dp_rank, self.config.dp_size
        if isinstance(msg, Pause):
            if self._group_paused:
                self._reject(f"rank {rank} paused while the group is already paused")
                return
            self._paused_ranks.add(rank)
            if len(self._paused_ranks) == dp_size:
                # Every rank's last RequestSteps came before its Pause on the
                # same ordered channel, so self.step is final.
                self._group_paused = True
                self._resumed_ranks.clear()
                logger.info("step sync: DP group paused at step %d", self.step)
                self._broadcast(GroupPaused(self.step))
            return
        if not self._group_paused:
            # Resumed before the group finished pausing: that rank just runs
            # on; the others keep waiting for it.
            self._paused_ranks.discard(rank)
            self._send(identity, GroupResumed())
            return
        self._resumed_ranks.add(rank)
        if len(self._resumed_ranks) == dp_size:
            self._group_paused = False
            self._paused_ranks.clear()
            logger.info("step sync: DP group resumed at step %d", self.step)
            self._broadcast(GroupResumed())

    def _register(self, identity: bytes, msg: Register) -> None:
        cfg = self.config
        if msg.dp_size != cfg.dp_size or msg.lookahead != cfg.lookahead:
            self._reject(
                f"rank {msg.dp_rank} has dp_size={msg.dp_size} lookahead={msg.lookahead}, "
                f"coordinator has dp_size={cfg.dp_size} lookahead={cfg.lookahead}",
            )
            return
        old = self._peers.get(msg.dp_rank)
        if old is not None and old.incarnation != msg.incarnation:
            # A restarted engine cannot rejoin collectives mid-flight.
            self._fail(f"DP rank {msg.dp_rank} re-registered as a new process")
            return
        self._peers[msg.dp_rank] = _PeerState(identity, msg.incarnation, time.monotonic())
        self._registered = tuple(sorted(self._peers))
        logger.info(
            "step sync: DP rank %d registered (%d/%d)", msg.dp_rank, len(self._peers), cfg.dp_size
        )
        self._send(identity, Grant(self.step))

    def _check_peers(self, now: float) -> None:
        for rank, peer in self._peers.items():
            silent = now - peer.last_seen
            if silent > self.config.peer_timeout_s:
                self._fail(f"DP rank {rank} silent for {silent:.1f}s (step_sync_peer_timeout_s="
                           f"{self.config.peer_timeout_s})")
                return

    def _fail(self, reason: str) -> None:
        if self._failed is None:
            self._broadcast(Abort(reason))
        self._fail_once(reason, "step sync coordinator")

    def _reject(self, why: str) -> None:
        self.counters.inc("malformed_messages")
        logger.warning("step sync coordinator: rejected message: %s", why)

    def _broadcast(self, msg: ToParticipant) -> None:
        for peer in self._peers.values():
            self._send(peer.identity, msg)

    def _send(self, identity: bytes, msg: ToParticipant) -> None:
        try:
            self._sock.send_multipart([identity, _encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # peer gone or its queue full; heartbeats will notice
        if isinstance(msg, Grant):
            self.counters.inc("grants_sent")


# --- participant -------------------------------------------------------------


class Participant(_NetworkThread):
    """One DP rank's side of the protocol.

    Engine thread API: :meth:`begin_forward` before every real or dummy
    forward pass, :meth:`observe_grant` for each step delivered through
    ``on_grant``, and :attr:`steps_owed` to decide whether a dummy pass is due.
    """

    def __init__(
        self,
        config: StepSyncConfig,
        dp_rank: int,
        coordinator_address: str,
        on_grant: Callable[[int], None],
        on_failure: Callable[[str], None],
        on_phase: Callable[[PhaseEvent], None] | None = None,
    ):
        if not 0 <= dp_rank < config.dp_size:
            raise ConfigError(f"dp_rank {dp_rank} outside [0, {config.dp_size})")
        super().__init__(f"StepSyncParticipant{dp_rank}", on_failure)
        self.config = config
        self.dp_rank = dp_rank
        self.coordinator_address = coordinator_address
        self.on_grant = on_grant
        self.on_phase = on_phase or (lambda event: None)
        # Network-thread state: highest step handed to on_grant (the
        # coordinator's heartbeat repeats its step; the engine needs it once).
        # The engine thread may wait on the condition for it to grow.
        self._delivered = 0
        self._delivered_grew = threading.Condition()
        # Engine-thread state.
        self.local_step = 0
        self.coord_step = 0
        self.requested = 0
        self.dummy_steps = 0
        self.forward_steps = 0
        self.counters = _Counters(
            "requests_sent", "grants_received", "malformed_messages", "grant_waits"
        )
        self._incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ctx, self._sock = _new_context_socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, f"dp{dp_rank}-{self._incarnation}".encode())
        self._sock.connect(coordinator_address)
        # Engine thread -> network thread, so only one thread touches each socket.
        self._outbox_addr = f"inproc://step-sync-{dp_rank}-{self._incarnation}"
        self._outbox_rx = ctx.socket(zmq.PULL)
        self._outbox_rx.setsockopt(zmq.LINGER, 0)
        self._outbox_rx.bind(self._outbox_addr)
        self._outbox_tx = ctx.socket(zmq.PUSH)
        self._outbox_tx.setsockopt(zmq.LINGER, 0)
        self._outbox_tx.connect(self._outbox_addr)
        self._sockets += [self._outbox_tx, self._outbox_rx, self._sock]

    # --- engine thread ---

    @property
    def steps_owed(self) -> int:
        """Forward passes this rank still owes the group (dummy if no work)."""
        return max(0, self.coord_step - self.local_step)

    def observe_grant(self, step: int) -> None:
        if step > self.coord_step:
            self.coord_step = step

    def begin_forward(self, dummy: bool) -> int:
        """Account for the forward pass about to run; return its step number.

        A real pass may run ahead of the grant: the coordinator is asked for
        ``lookahead`` steps past it before the remaining grant drops below the
        renewal margin, and ZMQ delivers in order, so every peer will be told.
        A real pass that nobody granted yet waits for its grant (see
        ``_await_grant``); with ``request_ahead`` that is rare.
        """
        self.local_step += 1
        if dummy:
            self.dummy_steps += 1
            return self.local_step
        self.forward_steps += 1
        if self._horizon - self.local_step < self.config.renew_margin:
            self._request_steps(self.local_step + self.config.lookahead)
        self._await_grant(self.local_step)
        return self.local_step

    def request_ahead(self) -> None:
        """Work arrived while this rank holds no grant beyond its last pass:
        ask for the next ``lookahead`` steps now and wait for the grant, so
        the peers start their dummy pass while this engine is still
        scheduling. If the work turns out unschedulable, the group runs at
        most ``lookahead`` dummy passes for it."""
        if self._horizon <= self.local_step:
            self._request_steps(self.local_step + self.config.lookahead)
            self._await_grant(self.local_step + 1)

    @property
    def _horizon(self) -> int:
        """Last step granted or already asked for: passes up to it need no request."""
        return max(self.requested, self.coord_step)

    def _request_steps(self, step: int) -> None:
        self.requested = step
        self._outbox_tx.send(_encoder.encode(RequestSteps(self.dp_rank, step)))
        self.counters.inc("requests_sent")

    def _await_grant(self, step: int) -> None:
        """Wait, up to ``MAX_GRANT_WAIT_S``, until ``step`` was granted.

        Only a rank waking an idle group waits, for one loopback round trip,
        and the wait costs nothing: its first pass would wait for its peers in
        the first collective anyway, and they start on that same grant. It
        matters because otherwise this thread goes on scheduling while holding
        the GIL, and the network thread that carries the request (and, on
        rank 0, the coordinator thread) gets to run only after the
        interpreter's switch interval (5 ms).
        """
        if self._delivered >= step:
            return
        self.counters.inc("grant_waits")
        with self._delivered_grew:
            self._delivered_grew.wait_for(
                lambda: self._delivered >= step or self._failed is not None, MAX_GRANT_WAIT_S
            )

    def request_pause(self) -> None:
        """Tell the group this rank paused: no more real passes until resume.
        Goes out after every earlier step request (same ordered channel)."""
        self._outbox_tx.send(_encoder.encode(Pause(self.dp_rank)))

    def request_resume(self) -> None:
        self._outbox_tx.send(_encoder.encode(Resume(self.dp_rank)))

    @property
    def stats(self) -> dict[str, int]:
        """Counters and step positions for metrics (any thread may read)."""
        return {
            **self.counters.snapshot(),
            "local_step": self.local_step,
            "coord_step": self.coord_step,
            "forward_steps": self.forward_steps,
            "dummy_steps": self.dummy_steps,
        }

    # --- network thread ---

    def _run(self) -> None:
        cfg = self.config
        self._send(Register(self.dp_rank, cfg.dp_size, cfg.lookahead, self._incarnation))
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._outbox_rx, zmq.POLLIN)
        last_heard = time.monotonic()
        next_heartbeat = last_heard + cfg.heartbeat_interval_s
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._outbox_rx in events:
                while True:
                    try:
                        self._sock.send(self._outbox_rx.recv(zmq.NOBLOCK), zmq.NOBLOCK)
                    except zmq.Again:
                        break
            if self._sock in events:
                while True:
                    try:
                        payload = self._sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if self._handle(payload):
                        last_heard = time.monotonic()
            now = time.monotonic()
            if now >= next_heartbeat:
                next_heartbeat = now + cfg.heartbeat_interval_s
                self._send(Heartbeat(self.dp_rank, self.local_step))
            if now - last_heard > cfg.peer_timeout_s:
                self._fail(
                    f"step sync coordinator silent for {now - last_heard:.1f}s "
                    f"(step_sync_peer_timeout_s={cfg.peer_timeout_s})"
                )
                return

    def _handle(self, payload: bytes) -> bool:
        try:
            msg = _to_participant.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.counters.inc("malformed_messages")
            logger.warning("step sync rank %d: rejected undecodable message", self.dp_rank)
            return False
        if isinstance(msg, Abort):
            self._fail(f"step sync coordinator aborted the DP group: {msg.reason}")
            return True
        if isinstance(msg, GroupResumed):
            self.on_phase(msg)
            return True
        if msg.step < 0:
            self.counters.inc("malformed_messages")
            return False
        if isinstance(msg, GroupPaused):
            self._deliver(msg.step)
            self.on_phase(msg)
            return True
        self.counters.inc("grants_received")
        if msg.step > self._delivered:
            self._deliver(msg.step)
            self.on_grant(msg.step)
        return True

    def _deliver(self, step: int) -> None:
        with self._delivered_grew:
            self._delivered = max(self._delivered, step)
            self._delivered_grew.notify_all()

    def _send(self, msg: ToCoordinator) -> None:
        try:
            self._sock.send(_encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # coordinator unreachable; the silence check reports it

    def _fail(self, reason: str) -> None:
        self._fail_once(reason, f"step sync rank {self.dp_rank}")


__all__ = [
    "Abort",
    "Coordinator",
    "Grant",
    "GroupPaused",
    "GroupResumed",
    "Heartbeat",
    "Participant",
    "Pause",
    "Register",
    "RequestSteps",
    "Resume",
    "StepSyncConfig",
]
