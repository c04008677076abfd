"""Step-synchronized data parallelism: the Coordinator/Participant protocol.

MoE DP ranks must run the same number of forward passes, because every pass
meets the other ranks in collectives. Instead of upstream's "waves" (a DP
coordinator process, START_DP_WAVE broadcasts, an all-reduce every N steps),
the ranks agree on a *coordinator step* ``G``: every rank runs forward passes
1..G, with dummy batches where it has no work of its own.

* One :class:`Coordinator` (a thread in DP rank 0's engine process) keeps
  ``G``, the group's phase (running, paused, exiting) and the members.
* One :class:`Participant` per DP rank. Its engine thread counts
  ``local_step`` (real or dummy forward passes done) and knows the latest
  ``coord_step`` granted. A rank with work that is about to run pass ``s``
  makes sure ``G >= s`` by asking for ``s + lookahead`` *before* it needs it
  (pipelined lease renewal). Ranks with ``local_step < G`` run dummy passes.

State, not events. Every message carries the sender's whole state, so a
message lost anywhere (a TCP reset that ZMQ papers over, a full queue, a
dropped send) is healed by the next one:

* a participant sends :class:`RankState` (the step it asked for, its pass
  count, its pause intent, whether it is leaving) whenever it changes, again
  every :data:`RESEND_INTERVAL_S` while the coordinator has not acknowledged
  it or while it waits for a grant, and as its heartbeat;
* the coordinator answers with :class:`GroupState` (``G``, the phase, the
  step the phase was agreed at, how many ranks joined, and which of the
  rank's messages it has seen), and repeats it to every rank as its heartbeat.

Failure is reported, never waited out: a peer silent for ``peer_timeout_s``,
a rank that owes passes and runs none, or one that ran an ungranted pass that
stays ungranted for that long, ends the group with a message naming it.

Membership is authenticated: every frame (the shared format of
``vllm_disagg/wire/frames.py``) carries an HMAC-SHA256 of its
payload under the group secret (which DP rank 0 publishes in the DP group's
TCP store), and a per-sender sequence number against replay. Unauthenticated,
malformed, stale or oversized frames are dropped and counted; their log lines
are rate-limited. No frame from outside the group can change its state.

Threading: the network side runs in one background thread per object. The
engine-side state of a participant is only touched by the engine thread;
grants and group-state changes reach it through callbacks that the engine
turns into items on its input queue.
"""

from __future__ import annotations

import enum
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import msgspec
import zmq
from vllm.utils.network_utils import is_valid_ipv6_address, make_zmq_path, split_zmq_path

from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger
from vllm_disagg.wire.frames import MAC_BYTES, FrameCodec, FrameError  # noqa: F401 (re-exported)
from vllm_disagg.wire.frames import harden_listener
from vllm_disagg.wire.logs import RateLimitedLog

logger = init_logger(__name__)

# Version 1: event messages (Register, RequestSteps, Pause, ...), no auth.
# Version 2: whole-state messages, HMAC-authenticated frames, shutdown phase.
PROTOCOL_VERSION = 2
# No legitimate frame is anywhere near this; ZMQ drops larger ones.
MAX_MESSAGE_BYTES = 1024
SECRET_BYTES = 32
# Heartbeats per peer_timeout_s; a peer must miss several before it is dead.
HEARTBEATS_PER_TIMEOUT = 5
# How often unacknowledged state (or a request still ungranted) is re-sent.
RESEND_INTERVAL_S = 0.1
# Longest the engine thread waits for a grant it asked for (see
# Participant._await_grant). Normally one loopback round trip, well under 1 ms.
MAX_GRANT_WAIT_S = 0.02
# At most one log line per kind of rejected frame per this many seconds.
REJECT_LOG_INTERVAL_S = 10.0
# How long close() waits for the coordinator to acknowledge a final state.
FLUSH_TIMEOUT_S = 2.0


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
    def resend_interval_s(self) -> float:
        return min(RESEND_INTERVAL_S, self.heartbeat_interval_s)

    @property
    def renew_margin(self) -> int:
        """Renew the lease when fewer than this many granted steps remain."""
        return (self.lookahead + 1) // 2


def new_group_secret() -> bytes:
    """A fresh random secret for one DP group (rank 0 publishes it)."""
    return secrets.token_bytes(SECRET_BYTES)


# --- wire messages -----------------------------------------------------------

Step = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Seq = Annotated[int, msgspec.Meta(ge=1, le=2**62)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=2**16)]
Incarnation = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class GroupPhase(enum.IntEnum):
    RUNNING = 0
    # Every rank paused and drained; all stop at ``phase_step``.
    PAUSED = 1
    # Every rank is shutting down and drained; all leave at ``phase_step``.
    EXITING = 2


class RankState(msgspec.Struct, tag="rank", array_like=True, forbid_unknown_fields=True):
    """Participant -> coordinator: everything the coordinator needs to know
    about one rank. Idempotent: the latest one wins."""

    version: int
    dp_rank: Rank
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=2**16)]
    lookahead: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    incarnation: Incarnation
    seq: Seq
    # Highest step this rank asked the group to run through.
    requested: Step
    # Forward passes (real or dummy) this rank has started.
    local_step: Step
    # Counts pause/resume calls; acknowledged back in GroupState.intent_ack.
    intent: Step
    # The latest intent: pause (True) or run (False).
    want_pause: bool
    # want_pause and locally drained: no more real passes from this rank.
    pause_ready: bool
    # Shutting down and locally drained: no more real passes from this rank.
    leaving: bool
    # Left the busy loop (after the agreed exit step, or alone).
    left: bool


class GroupState(msgspec.Struct, tag="group", array_like=True, forbid_unknown_fields=True):
    """Coordinator -> participant: the group as the coordinator sees it."""

    version: int
    seq: Seq
    step: Step
    phase: GroupPhase
    # Step at which the current phase was agreed (G when it was).
    phase_step: Step
    # Ranks registered so far; the group runs once all dp_size joined.
    members: Step
    # Highest RankState.seq and .intent of this rank the coordinator processed.
    ack_seq: Step
    intent_ack: Step


class Abort(msgspec.Struct, tag="abort", array_like=True, forbid_unknown_fields=True):
    """Either direction: the group cannot continue (or this rank may not join)."""

    version: int
    seq: Seq
    reason: Annotated[str, msgspec.Meta(max_length=512)]


ToCoordinator = RankState | Abort
ToParticipant = GroupState | Abort

# Direction labels inside the MAC, so a frame cannot be reflected back.
_TO_COORDINATOR = FrameCodec(b"P2C", msgspec.msgpack.Decoder(ToCoordinator), MAX_MESSAGE_BYTES)
_TO_PARTICIPANT = FrameCodec(b"C2P", msgspec.msgpack.Decoder(ToParticipant), MAX_MESSAGE_BYTES)


def _seal(secret: bytes, codec: FrameCodec, msg: msgspec.Struct) -> list[bytes]:
    return codec.seal(secret, msg)


def _open(secret: bytes, codec: FrameCodec, frames: list[bytes]):
    """Authenticate and decode ``[payload, mac]``: (message, None), or
    (None, the reason why not)."""
    try:
        msg = codec.open(secret, frames)
    except FrameError as e:
        return None, _REASONS.get(e.kind, e.kind)
    if msg.version != PROTOCOL_VERSION:
        return None, f"protocol version {msg.version}, expected {PROTOCOL_VERSION}"
    return msg, None


# FrameError kinds in the words of this module's log lines.
_REASONS = {"unauthenticated": "unauthenticated frame", "malformed": "undecodable message",
            "oversized": "oversized frame"}  # fmt: skip


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


def _socket(kind: int, address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    _, host, _ = split_zmq_path(address)
    if is_valid_ipv6_address(host):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


class _NetworkThread:
    """What both roles share: one background thread that owns the sockets,
    a stop flag, and a failure reported at most once."""

    def __init__(self, thread_name: str, on_failure: Callable[[str], None]):
        self.on_failure = on_failure
        self._stop = threading.Event()
        self._failed: str | None = None
        self._sockets: list[zmq.Socket] = []
        # How long close() lets queued frames (a final Abort) go out.
        self._close_linger_ms = 0
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    @property
    def failure(self) -> str | None:
        """The failure reported, if any."""
        return self._failed

    def start(self):
        self._thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        for sock in self._sockets:
            sock.close(linger=self._close_linger_ms)

    def _fail_once(self, reason: str, log_prefix: str) -> bool:
        """Log and report ``reason`` unless a failure was already reported."""
        if self._failed is not None:
            return False
        self._failed = reason
        logger.error("%s: %s", log_prefix, reason)
        self.on_failure(reason)
        return True


# --- coordinator -------------------------------------------------------------


@dataclass
class _Member:
    route: bytes  # ZMQ routing id of the connection it last wrote from
    state: RankState
    last_seen: float


class Coordinator(_NetworkThread):
    """Keeps the coordinator step and the group phase; tells every member.

    Runs a background thread bound to ``address`` (a ZMQ TCP endpoint; port
    0 picks a free port, see :attr:`address`). Every ``dp_size`` rank must
    register within ``peer_timeout_s`` of :meth:`start`, or the group fails.
    """

    def __init__(
        self,
        config: StepSyncConfig,
        address: str,
        secret: bytes,
        on_failure: Callable[[str], None] | None = None,
    ):
        super().__init__("StepSyncCoordinator", on_failure or (lambda reason: None))
        self.config = config
        self._secret = secret
        self.step = 0
        self.phase = GroupPhase.RUNNING
        self.phase_step = 0
        self.counters = _Counters(
            "grants_sent",
            "requests_received",
            "malformed_messages",
            "unauthenticated_messages",
            "stale_messages",
            "pause_violations",
        )
        self._members: dict[int, _Member] = {}
        # Rebuilt (never mutated) on registration, so other threads can read it.
        self._registered: tuple[int, ...] = ()
        self._rejected: dict[int, str] = {}
        self._seq = 0
        self._log_prefix = "step sync coordinator"
        self._log = RateLimitedLog(logger, REJECT_LOG_INTERVAL_S)
        self._abort_on_close: str | None = None
        self._sock = _socket(zmq.ROUTER, address)
        harden_listener(self._sock, MAX_MESSAGE_BYTES)
        self._sockets.append(self._sock)
        scheme, host, port = split_zmq_path(address)
        if port == "0":
            bracketed = f"[{host}]" if is_valid_ipv6_address(host) else host
            port = self._sock.bind_to_random_port(f"{scheme}://{bracketed}")
            address = make_zmq_path(scheme, host, port)
        else:
            self._sock.bind(address)
        self.address = address

    @property
    def registered(self) -> list[int]:
        return list(self._registered)

    @property
    def all_left(self) -> bool:
        """Every member left the busy loop (the coordinator may go)."""
        members = list(self._members.values())
        return len(members) == self.config.dp_size and all(m.state.left for m in members)

    @property
    def stats(self) -> dict[str, int]:
        return {**self.counters.snapshot(), "coordinator_step": self.step}

    def close(self, timeout_s: float = 5.0, abort_reason: str | None = None) -> None:
        """Stop; unless every member already left, tell them the group is
        over first (so they fail now, not after ``peer_timeout_s``)."""
        self._abort_on_close = abort_reason or "the coordinator (DP rank 0) shut down"
        super().close(timeout_s)

    # The thread owns the socket from here on.
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        started = time.monotonic()
        interval = self.config.heartbeat_interval_s
        next_heartbeat = started + interval
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
                self._broadcast()
                self._check_members(now, started)
        if self._failed is None and not self.all_left:
            self._abort(self._abort_on_close or "the coordinator stopped")
            # Give the Abort frames a moment to leave before the socket closes.
            self._close_linger_ms = 500

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self._drop("malformed_messages", "frame", "no payload")
            return
        route, body = frames[0], frames[1:]
        msg, why = _open(self._secret, _TO_COORDINATOR, body)
        if msg is None:
            counter = "unauthenticated_messages" if why == "unauthenticated frame" else (
                "malformed_messages"
            )
            self._drop(counter, why, why)
            return
        if isinstance(msg, Abort):
            self._drop("malformed_messages", "abort", "Abort from a participant")
            return
        if self._failed is not None:
            # The first Abort went only to the members of that moment, and a
            # frame can be lost: every rank that still speaks hears why.
            self._send(route, Abort(PROTOCOL_VERSION, self._next_seq(), self._failed))
            return
        self._on_rank_state(route, msg)

    def _on_rank_state(self, route: bytes, msg: RankState) -> None:
        rank = msg.dp_rank
        if rank >= self.config.dp_size:
            self._drop("malformed_messages", "rank", f"dp_rank {rank} >= {self.config.dp_size}")
            return
        member = self._members.get(rank)
        if member is None:
            if not self._admit(route, msg):
                return
            member = self._members[rank]
        elif member.state.incarnation != msg.incarnation:
            # Authenticated, so a real engine: a restarted rank cannot rejoin
            # collectives mid-flight.
            self._fail(f"DP rank {rank} re-registered as a new process ({msg.incarnation})")
            return
        elif msg.seq <= member.state.seq:
            self._drop("stale_messages", "stale", f"replayed or stale frame from rank {rank}")
            return
        bound = max(self.step, msg.local_step) + self.config.lookahead + 1
        if msg.requested > bound:
            self._drop(
                "malformed_messages",
                "range",
                f"rank {rank} asked for step {msg.requested} at coordinator step {self.step}",
            )
            return
        previous = member.state
        member.route, member.state, member.last_seen = route, msg, time.monotonic()
        changed = False
        if msg.requested > self.step:
            self.counters.inc("requests_received")
            if self.phase != GroupPhase.RUNNING or msg.pause_ready or msg.leaving:
                # A rank that promised no more work asked for more. Granting
                # keeps the group out of a collective deadlock; the count
                # makes the bug visible.
                self.counters.inc("pause_violations")
                logger.warning(
                    "step sync: rank %d asked for step %d after promising no more work",
                    rank,
                    msg.requested,
                )
            self.step = msg.requested
            changed = True
            logger.debug("step sync: rank %d extended coordinator step to %d", rank, self.step)
        if msg.left and not previous.left and self.phase != GroupPhase.EXITING:
            self._fail(f"DP rank {rank} left the group (its engine shut down)")
            return
        changed |= self._advance_phase()
        if changed:
            self._broadcast()
        else:
            self._send_state(member)

    def _admit(self, route: bytes, msg: RankState) -> bool:
        cfg = self.config
        if msg.dp_size != cfg.dp_size or msg.lookahead != cfg.lookahead:
            reason = (
                f"DP rank {msg.dp_rank} was rejected: it has data_parallel_size="
                f"{msg.dp_size} step_sync_lookahead={msg.lookahead}, DP rank 0 has "
                f"data_parallel_size={cfg.dp_size} step_sync_lookahead={cfg.lookahead} "
                "(every rank needs the same --data-parallel-size and --additional-config)"
            )
            self._rejected[msg.dp_rank] = reason
            self._send(route, Abort(PROTOCOL_VERSION, self._next_seq(), reason))
            self._fail(reason)
            return False
        self._members[msg.dp_rank] = _Member(route, msg, time.monotonic())
        self._registered = tuple(sorted(self._members))
        logger.info(
            "step sync: DP rank %d registered (%d/%d)", msg.dp_rank, len(self._members),
            cfg.dp_size,
        )
        # Everyone learns the new member count (the group starts at dp_size).
        self._broadcast()
        return True

    def _advance_phase(self) -> bool:
        """Move the group phase when every rank agrees; True if it moved."""
        if len(self._members) < self.config.dp_size or self.phase == GroupPhase.EXITING:
            return False
        states = [m.state for m in self._members.values()]
        if all(s.leaving or s.left for s in states):
            # Each rank's last request came in the same message as its
            # leaving flag (or before it), so G is final.
            self.phase, self.phase_step = GroupPhase.EXITING, self.step
            logger.info("step sync: DP group leaves at step %d", self.step)
            return True
        if self.phase == GroupPhase.RUNNING and all(s.pause_ready for s in states):
            self.phase, self.phase_step = GroupPhase.PAUSED, self.step
            logger.info("step sync: DP group paused at step %d", self.step)
            return True
        if self.phase == GroupPhase.PAUSED and not any(s.want_pause for s in states):
            self.phase, self.phase_step = GroupPhase.RUNNING, self.step
            logger.info("step sync: DP group resumed at step %d", self.step)
            return True
        return False

    def _check_members(self, now: float, started: float) -> None:
        missing = [r for r in range(self.config.dp_size) if r not in self._members]
        if missing and now - started > self.config.peer_timeout_s:
            self._fail(
                f"DP rank(s) {', '.join(map(str, missing))} did not join the step-sync group "
                f"within {self.config.peer_timeout_s:.0f}s (step_sync_peer_timeout_s); "
                "every rank must start with the same --data-parallel-size, "
                "--data-parallel-address and --additional-config"
            )
            return
        for rank, member in self._members.items():
            silent = now - member.last_seen
            if not member.state.left and silent > self.config.peer_timeout_s:
                self._fail(
                    f"DP rank {rank} silent for {silent:.1f}s (step_sync_peer_timeout_s="
                    f"{self.config.peer_timeout_s})"
                )
                return

    def _fail(self, reason: str) -> None:
        if self._failed is None:
            self._abort(reason)
        self._fail_once(reason, "step sync coordinator")

    def _abort(self, reason: str) -> None:
        for member in self._members.values():
            self._send(member.route, Abort(PROTOCOL_VERSION, self._next_seq(), reason))

    def _drop(self, counter: str, kind: str, detail: str) -> None:
        self.counters.inc(counter)
        self._log.warning(kind, "%s: dropped frame: %s", self._log_prefix, detail)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _broadcast(self) -> None:
        if self._failed is not None:
            return
        for member in self._members.values():
            self._send_state(member)

    def _send_state(self, member: _Member) -> None:
        state = GroupState(
            PROTOCOL_VERSION,
            self._next_seq(),
            self.step,
            self.phase,
            self.phase_step,
            len(self._members),
            member.state.seq,
            member.state.intent,
        )
        self._send(member.route, state)
        self.counters.inc("grants_sent")

    def _send(self, route: bytes, msg: ToParticipant) -> None:
        try:
            self._sock.send_multipart(
                [route, *_seal(self._secret, _TO_PARTICIPANT, msg)], zmq.NOBLOCK
            )
        except zmq.ZMQError:
            pass  # peer gone or its queue full; the next state heals it


# --- participant -------------------------------------------------------------


class Participant(_NetworkThread):
    """One DP rank's side of the protocol.

    Engine thread API: :meth:`begin_forward` before every real or dummy
    forward pass, :meth:`observe_grant` for each step delivered through
    ``on_grant``, :attr:`steps_owed` to decide whether a dummy pass is due,
    :meth:`set_pause_intent` / :meth:`set_pause_ready` / :meth:`set_leaving`
    for the group phases, and :attr:`group` for the latest group state
    (``on_group`` announces each change of it).
    """

    def __init__(
        self,
        config: StepSyncConfig,
        dp_rank: int,
        coordinator_address: str,
        secret: bytes,
        on_grant: Callable[[int], None],
        on_failure: Callable[[str], None],
        on_group: Callable[[GroupState], None] | None = None,
    ):
        if not 0 <= dp_rank < config.dp_size:
            raise ConfigError(f"dp_rank {dp_rank} outside [0, {config.dp_size})")
        super().__init__(f"StepSyncParticipant{dp_rank}", on_failure)
        self.config = config
        self.dp_rank = dp_rank
        self.coordinator_address = coordinator_address
        self._secret = secret
        self.on_grant = on_grant
        self.on_group = on_group or (lambda state: None)
        # Network-thread state. The engine thread may wait on the condition
        # for the delivered step (or the member count) to grow.
        self._delivered = 0
        self._delivered_grew = threading.Condition()
        self.group: GroupState | None = None
        # Engine-thread state.
        self.local_step = 0
        self.coord_step = 0
        self.requested = 0
        self.dummy_steps = 0
        self.forward_steps = 0
        self.intent = 0
        self._want_pause = False
        self._pause_ready = False
        self._leaving = False
        self._left = False
        # Set by the engine once its busy loop runs: before that (loading the
        # model) it cannot run the passes it owes, and that is no failure.
        self.watch_progress = False
        self.counters = _Counters(
            "requests_sent",
            "grants_received",
            "malformed_messages",
            "grant_waits",
            "resends",
        )
        self._incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._log_prefix = f"step sync rank {dp_rank}"
        self._log = RateLimitedLog(logger, REJECT_LOG_INTERVAL_S)
        # The latest state the engine thread published (the network thread
        # adds seq and local_step when it sends it).
        self._state = self._snapshot()
        # Network-thread send bookkeeping: the last sequence number used, and
        # the first one that carried the current state (an acknowledgement
        # must reach it before the state counts as delivered).
        self._seq = 0
        self._state_first_seq = 1
        self._last_sent_state: RankState | None = None
        self._sock = _socket(zmq.DEALER, coordinator_address)
        self._sock.connect(coordinator_address)
        # Engine thread -> network thread wake-ups: "the state changed".
        ctx = zmq.Context.instance()
        wake_addr = f"inproc://step-sync-{dp_rank}-{self._incarnation}"
        self._wake_rx = ctx.socket(zmq.PULL)
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = ctx.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_addr)
        self._sockets += [self._wake_tx, self._wake_rx, self._sock]

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
        renewal margin. A real pass that nobody granted yet waits for its
        grant (see ``_await_grant``); with ``request_ahead`` that is rare.
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

    def set_pause_intent(self, pause: bool) -> int:
        """A pause (True) or resume (False) call on this rank; returns the
        intent number the coordinator acknowledges in ``intent_ack``."""
        self.intent += 1
        self._want_pause = pause
        self._pause_ready = False
        self._publish()
        return self.intent

    def set_pause_ready(self) -> None:
        """Paused and locally drained: no more real passes until resumed."""
        if self._want_pause and not self._pause_ready:
            self._pause_ready = True
            self._publish()

    def set_leaving(self) -> None:
        """Shutting down and locally drained: no more real passes."""
        if not self._leaving:
            self._leaving = True
            self._publish()

    def wait_for_group(self, timeout_s: float) -> None:
        """Block until all ``dp_size`` ranks joined; raise with the reason
        (the coordinator's, when it gave one) if the group does not form."""
        deadline = time.monotonic() + timeout_s
        with self._delivered_grew:
            self._delivered_grew.wait_for(
                lambda: self._failed is not None
                or (self.group is not None and self.group.members >= self.config.dp_size),
                max(0.0, deadline - time.monotonic()),
            )
        if self._failed is not None:
            raise StepSyncGroupError(self._failed)
        if self.group is None or self.group.members < self.config.dp_size:
            joined = 0 if self.group is None else self.group.members
            raise StepSyncGroupError(
                f"DP rank {self.dp_rank}: the step-sync group at {self.coordinator_address} "
                f"did not form within {timeout_s:.0f}s ({joined}/{self.config.dp_size} "
                "ranks joined)"
            )

    @property
    def _horizon(self) -> int:
        """Last step granted or already asked for: passes up to it need no request."""
        return max(self.requested, self.coord_step)

    def _request_steps(self, step: int) -> None:
        self.requested = step
        self.counters.inc("requests_sent")
        self._publish()

    def _snapshot(self) -> RankState:
        cfg = self.config
        return RankState(
            PROTOCOL_VERSION,
            self.dp_rank,
            cfg.dp_size,
            cfg.lookahead,
            self._incarnation,
            1,
            self.requested,
            self.local_step,
            self.intent,
            self._want_pause,
            self._pause_ready,
            self._leaving,
            self._left,
        )

    def _publish(self) -> None:
        self._state = self._snapshot()
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already queued; the resend timer is the backstop

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

    def close(self, timeout_s: float = 5.0) -> None:
        """Leave: tell the coordinator (waiting briefly for it to hear it,
        so it does not take the silence for a failure), then stop."""
        if self._thread.is_alive() and self._failed is None:
            self._left = True
            self._publish()
            final = self._state
            deadline = time.monotonic() + min(FLUSH_TIMEOUT_S, timeout_s)
            while time.monotonic() < deadline and self._failed is None:
                group = self.group
                if (
                    self._last_sent_state is final
                    and group is not None
                    and group.ack_seq >= self._state_first_seq
                ):
                    break
                time.sleep(0.01)
        super().close(timeout_s)

    # --- network thread ---

    def _run(self) -> None:
        cfg = self.config
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        last_heard = time.monotonic()
        last_sent = self._send_state()
        sent_state = self._state
        watch = _ProgressWatch()
        while not self._stop.is_set():
            events = dict(poller.poll(int(cfg.resend_interval_s * 1000)))
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            if self._sock in events:
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if self._handle(frames):
                        last_heard = time.monotonic()
                if self._failed is not None:
                    return
            now = time.monotonic()
            state = self._state
            if state is not sent_state or self._needs_resend(now - last_sent):
                if state is sent_state:
                    self.counters.inc("resends")
                last_sent, sent_state = self._send_state(), state
            if now - last_heard > cfg.peer_timeout_s:
                self._fail(
                    f"step sync coordinator silent for {now - last_heard:.1f}s "
                    f"(step_sync_peer_timeout_s={cfg.peer_timeout_s})"
                )
                return
            if stalled := watch.check(self, now):
                # Where this rank's engine is stuck is in its threads and its
                # workers' threads: into the log, before the engine exits.
                from vllm_disagg.diagnostics import dump_stacks

                dump_stacks(stalled)
                self._fail(stalled)
                return

    def _needs_resend(self, since_sent: float) -> bool:
        if since_sent >= self.config.heartbeat_interval_s:
            return True
        if since_sent < self.config.resend_interval_s:
            return False
        group = self.group
        unacked = group is None or group.ack_seq < self._state_first_seq
        waiting = self._delivered < max(self.requested, self.local_step)
        return unacked or waiting

    def _send_state(self) -> float:
        state = self._state
        self._seq += 1
        if state is not self._last_sent_state:
            self._state_first_seq, self._last_sent_state = self._seq, state
        msg = msgspec.structs.replace(state, seq=self._seq, local_step=self.local_step)
        try:
            self._sock.send_multipart(_seal(self._secret, _TO_COORDINATOR, msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet or queue full: the resend timer heals it
        return time.monotonic()

    def _handle(self, frames: list[bytes]) -> bool:
        msg, why = _open(self._secret, _TO_PARTICIPANT, frames)
        if msg is None:
            self.counters.inc("malformed_messages")
            self._log.warning(why, "%s: dropped frame: %s", self._log_prefix, why)
            return False
        if isinstance(msg, Abort):
            self._fail(f"step sync coordinator aborted the DP group: {msg.reason}")
            return True
        previous = self.group
        if previous is not None and msg.seq <= previous.seq:
            self.counters.inc("malformed_messages")
            return False
        self.counters.inc("grants_received")
        with self._delivered_grew:
            self.group = msg
            grew = msg.step > self._delivered
            self._delivered = max(self._delivered, msg.step)
            self._delivered_grew.notify_all()
        if grew:
            self.on_grant(msg.step)
        if previous is None or (
            (msg.phase, msg.phase_step, msg.members, msg.intent_ack)
            != (previous.phase, previous.phase_step, previous.members, previous.intent_ack)
        ):
            self.on_group(msg)
        return True

    def _fail(self, reason: str) -> None:
        self._fail_once(reason, f"step sync rank {self.dp_rank}")
        with self._delivered_grew:
            self._delivered_grew.notify_all()


class _ProgressWatch:
    """Notices a rank that cannot make progress: it owes passes and runs
    none, or it ran a pass nobody granted and the grant never comes. Either
    means a collective is (or soon will be) stuck; report it rather than hang.
    """

    def __init__(self):
        self._since: float | None = None
        self._mark: tuple[int, int] | None = None

    def check(self, part: Participant, now: float) -> str | None:
        local, granted = part.local_step, part._delivered
        stuck = part.watch_progress and local != granted
        mark = (local, granted)
        if not stuck or mark != self._mark:
            self._mark, self._since = mark, (now if stuck else None)
            return None
        if now - self._since <= part.config.peer_timeout_s:
            return None
        waited = now - self._since
        if local > granted:
            return (
                f"DP rank {part.dp_rank} ran pass {local} but the group granted only up to "
                f"{granted} for {waited:.1f}s (step_sync_peer_timeout_s="
                f"{part.config.peer_timeout_s})"
            )
        return (
            f"DP rank {part.dp_rank} owes passes {local + 1}..{granted} but ran none for "
            f"{waited:.1f}s (its engine is stuck or asleep; step_sync_peer_timeout_s="
            f"{part.config.peer_timeout_s})"
        )


class StepSyncGroupError(RuntimeError):
    """The step-sync group did not form or cannot go on."""


__all__ = [
    "Abort",
    "Coordinator",
    "GroupPhase",
    "GroupState",
    "Participant",
    "PROTOCOL_VERSION",
    "RankState",
    "StepSyncConfig",
    "StepSyncGroupError",
    "new_group_secret",
]
