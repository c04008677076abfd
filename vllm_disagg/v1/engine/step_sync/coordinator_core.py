"""The coordinator's rules as a plain state machine: frames in, messages out.

No socket, thread or clock: the shell (``coordinator.py``) hands in every frame it
receives and the time, and sends what comes back, so tests drive the phase rules
directly, thousands of interleavings a second. The rules:

* ``G`` (:attr:`CoordinatorCore.step`) only grows, to the highest step any member asked
  for, and never past ``max(G, the asker's pass count) + lookahead + 1``; every rank
  hears each new ``G`` in the same broadcast, so no rank is granted a step the others
  were not.
* The group pauses when every rank is paused and drained, resumes when none wants a
  pause, and exits (finally) when every rank is leaving; each at the ``G`` of that
  moment.
* It fails, and tells every member why, when a rank is missing ``peer_timeout_s`` after
  start, a member is silent that long, a rank comes back as a new process, leaves
  outside an agreed exit, or joins with other options.
* Only authenticated frames count (:meth:`CoordinatorCore.on_frames`): the others are
  dropped and counted, and change nothing. Every failure above is either a timeout or
  a frame under the group's key, which only members hold (``credentials.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_disagg.logger import init_logger
from vllm_disagg.v1.engine.step_sync.config import REJECT_LOG_INTERVAL_S, StepSyncConfig
from vllm_disagg.v1.engine.step_sync.messages import (
    PROTOCOL_VERSION,
    TO_COORDINATOR,
    UNAUTHENTICATED,
    Abort,
    Counters,
    GroupPhase,
    GroupState,
    RankState,
    ToCoordinator,
    ToParticipant,
    open_frames,
)
from vllm_disagg.wire.logs import RateLimitedLog

logger = init_logger(__name__)

# A message for one member: (its ZMQ routing id, the message).
Send = tuple[bytes, ToParticipant]


@dataclass
class Member:
    route: bytes  # ZMQ routing id of the connection it last wrote from
    state: RankState
    last_seen: float


class CoordinatorCore:
    """Keeps the coordinator step ``G``, the group phase and the members.

    Every entry point returns the messages to send, in order. :attr:`failed` is set
    once, when the group fails; the Aborts that tell the members are among the messages
    returned then.
    """

    def __init__(self, config: StepSyncConfig, secret: bytes):
        self.config = config
        self._secret = secret
        self.step = 0
        self.phase = GroupPhase.RUNNING
        self.phase_step = 0
        self.failed: str | None = None
        self.counters = Counters(
            "frames_received",
            "grants_sent",
            "requests_received",
            "malformed_messages",
            "unauthenticated_messages",
            "stale_messages",
            "pause_violations",
        )
        self.members: dict[int, Member] = {}
        # Rebuilt (never mutated) on registration, so other threads can read it.
        self.registered: tuple[int, ...] = ()
        self.rejected: dict[int, str] = {}
        self._seq = 0
        self._started = 0.0
        self.next_heartbeat = 0.0
        self._out: list[Send] = []
        # Inside on_frame_batch: the members owed a GroupState, sent once at its end
        # (None: not batching; every state goes out at once).
        self._owed: dict[int, Member] | None = None
        self._log_prefix = "step sync coordinator"
        self._log = RateLimitedLog(logger, REJECT_LOG_INTERVAL_S)

    @property
    def all_left(self) -> bool:
        """Every member left the busy loop (the coordinator may go)."""
        members = list(self.members.values())
        return len(members) == self.config.dp_size and all(
            m.state.left for m in members
        )

    # --- entry points ---

    def start(self, now: float) -> None:
        """The join deadline (``peer_timeout_s``) and the heartbeats count from
        ``now``."""
        self._started = now
        self.next_heartbeat = now + self.config.heartbeat_interval_s

    def on_frames(self, frames: list[bytes], now: float) -> list[Send]:
        """One multipart message from the ROUTER socket: ``[route, payload, mac]``."""
        self.counters.inc("frames_received")
        if len(frames) < 2:
            self._drop("malformed_messages", "frame", "no payload")
            return []
        msg, why = open_frames(self._secret, TO_COORDINATOR, frames[1:])
        if msg is None:
            counter = (
                "unauthenticated_messages"
                if why == UNAUTHENTICATED
                else ("malformed_messages")
            )
            self._drop(counter, why, why)
            return []
        return self.on_message(frames[0], msg, now)

    def on_frame_batch(self, batch: list[list[bytes]], now: float) -> list[Send]:
        """Several frames that arrived together, answered together: each member owed
        a ``GroupState`` gets one, carrying the group state after the whole batch.

        When every rank asks for the next steps at once, the first request moves
        ``G`` and the others need only an acknowledgement; one at a time that is a
        broadcast plus a reply per rank, batched it is one state per rank (the
        coordinator's messages per renewal drop from about 3N to 2N).
        """
        self._owed = {}
        try:
            for frames in batch:
                sent = self.on_frames(frames, now)  # takes self._out: then add it back
                self._out.extend(sent)
        finally:
            owed, self._owed = self._owed, None
        if self.failed is None:
            for member in owed.values():
                self._send_state(member)
        return self._take()

    def on_message(self, route: bytes, msg: ToCoordinator, now: float) -> list[Send]:
        """An authenticated message from ``route``."""
        if isinstance(msg, Abort):
            self._drop("malformed_messages", "abort", "Abort from a participant")
            return []
        if self.failed is not None:
            # The first Abort went only to the members of that moment, and a
            # frame can be lost: every rank that still speaks hears why.
            return [(route, Abort(PROTOCOL_VERSION, self._next_seq(), self.failed))]
        self._on_rank_state(route, msg, now)
        return self._take()

    def on_tick(self, now: float) -> list[Send]:
        """Heartbeat when one is due: every member hears the group state, and missing or
        silent ranks fail the group."""
        if now < self.next_heartbeat:
            return []
        self.next_heartbeat = now + self.config.heartbeat_interval_s
        self._broadcast()
        self._check_members(now)
        return self._take()

    def on_close(self, reason: str) -> list[Send]:
        """Unless the group failed or every member left, tell the members it is over (so
        they fail now, not after ``peer_timeout_s``)."""
        if self.failed is None and not self.all_left:
            self._abort(reason)
        return self._take()

    # --- rules ---

    def _on_rank_state(self, route: bytes, msg: RankState, now: float) -> None:
        rank = msg.dp_rank
        if rank >= self.config.dp_size:
            self._drop(
                "malformed_messages", "rank", f"dp_rank {rank} >= {self.config.dp_size}"
            )
            return
        member = self.members.get(rank)
        if member is None:
            if not self._admit(route, msg, now):
                return
            member = self.members[rank]
        elif member.state.incarnation != msg.incarnation:
            # Authenticated under this group's key: a process that was given the
            # group's secret (by the launcher or the operator) and read this
            # group's id, i.e. the rank's engine restarted or started twice. It
            # cannot rejoin collectives mid-flight and the group cannot go on
            # without the process it replaces: the group fails now, naming it,
            # and the newcomer hears why. A stranger's frame never gets here
            # (on_frames drops and counts it).
            reason = (
                f"DP rank {rank} re-registered as a new process ({msg.incarnation})"
            )
            if route != member.route:
                self._out.append(
                    (route, Abort(PROTOCOL_VERSION, self._next_seq(), reason))
                )
            self._fail(reason)
            return
        elif msg.seq <= member.state.seq:
            self._drop(
                "stale_messages", "stale", f"replayed or stale frame from rank {rank}"
            )
            return
        bound = max(self.step, msg.local_step) + self.config.lookahead + 1
        if msg.requested > bound:
            self._drop(
                "malformed_messages",
                "range",
                f"rank {rank} asked for step {msg.requested} at coordinator step "
                f"{self.step}",
            )
            return
        previous = member.state
        member.route, member.state, member.last_seen = route, msg, now
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
            logger.debug(
                "step sync: rank %d extended coordinator step to %d", rank, self.step
            )
        if msg.left and not previous.left and self.phase != GroupPhase.EXITING:
            self._fail(f"DP rank {rank} left the group (its engine shut down)")
            return
        changed |= self._advance_phase()
        if changed:
            self._broadcast()
        else:
            self._send_state(member)

    def _admit(self, route: bytes, msg: RankState, now: float) -> bool:
        cfg = self.config
        if msg.dp_size != cfg.dp_size or msg.lookahead != cfg.lookahead:
            reason = (
                f"DP rank {msg.dp_rank} was rejected: it has data_parallel_size="
                f"{msg.dp_size} step_sync_lookahead={msg.lookahead}, DP rank 0 has "
                f"data_parallel_size={cfg.dp_size} step_sync_lookahead={cfg.lookahead} "
                "(every rank needs the same --data-parallel-size and "
                "--additional-config)"
            )
            self.rejected[msg.dp_rank] = reason
            self._out.append((route, Abort(PROTOCOL_VERSION, self._next_seq(), reason)))
            self._fail(reason)
            return False
        self.members[msg.dp_rank] = Member(route, msg, now)
        self.registered = tuple(sorted(self.members))
        logger.info(
            "step sync: DP rank %d registered (%d/%d)",
            msg.dp_rank,
            len(self.members),
            cfg.dp_size,
        )
        # Everyone learns the new member count (the group starts at dp_size).
        self._broadcast()
        return True

    def _advance_phase(self) -> bool:
        """Move the group phase when every rank agrees; True if it moved."""
        if len(self.members) < self.config.dp_size or self.phase == GroupPhase.EXITING:
            return False
        states = [m.state for m in self.members.values()]
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

    def _check_members(self, now: float) -> None:
        missing = [r for r in range(self.config.dp_size) if r not in self.members]
        if missing and now - self._started > self.config.peer_timeout_s:
            self._fail(
                f"DP rank(s) {', '.join(map(str, missing))} did not join the step-sync "
                f"group within {self.config.peer_timeout_s:.0f}s "
                "(step_sync_peer_timeout_s); every rank must start with the same "
                "--data-parallel-size, --data-parallel-address and --additional-config"
                + self._unauthenticated_note()
            )
            return
        for rank, member in self.members.items():
            silent = now - member.last_seen
            if not member.state.left and silent > self.config.peer_timeout_s:
                self._fail(
                    f"DP rank {rank} silent for {silent:.1f}s "
                    f"(step_sync_peer_timeout_s={self.config.peer_timeout_s})"
                )
                return

    def _unauthenticated_note(self) -> str:
        dropped = self.counters.snapshot()["unauthenticated_messages"]
        if not dropped:
            return ""
        return (
            f", and the same step-sync secret ({dropped} frames failed authentication)"
        )

    # --- output ---

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self._abort(reason)
            self.failed = reason

    def _abort(self, reason: str) -> None:
        for member in self.members.values():
            self._out.append(
                (member.route, Abort(PROTOCOL_VERSION, self._next_seq(), reason))
            )

    def _drop(self, counter: str, kind: str, detail: str) -> None:
        self.counters.inc(counter)
        self._log.warning(kind, "%s: dropped frame: %s", self._log_prefix, detail)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _broadcast(self) -> None:
        if self.failed is not None:
            return
        for member in self.members.values():
            self._send_state(member)

    def _send_state(self, member: Member) -> None:
        if self._owed is not None:
            self._owed[member.state.dp_rank] = member
            return
        state = GroupState(
            PROTOCOL_VERSION,
            self._next_seq(),
            self.step,
            self.phase,
            self.phase_step,
            len(self.members),
            member.state.seq,
            member.state.intent,
        )
        self._out.append((member.route, state))
        self.counters.inc("grants_sent")

    def _take(self) -> list[Send]:
        out, self._out = self._out, []
        return out
