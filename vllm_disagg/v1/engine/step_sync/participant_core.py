"""One rank's side of the protocol as a plain state machine.

Two halves, each touched by one thread of the shell (``participant.py``), neither doing
I/O:

* the engine half counts passes and decides when to ask for steps
  (:meth:`begin_forward`, :meth:`request_ahead`, the pause and leave intents); every
  change makes a new :attr:`state`;
* the network half turns :attr:`state` into the next :class:`RankState` to send, takes
  the coordinator's frames in, and decides when to re-send and when the group has
  failed, with the time passed in.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from vllm_disagg.logger import init_logger
from vllm_disagg.v1.engine.step_sync.config import REJECT_LOG_INTERVAL_S, StepSyncConfig
from vllm_disagg.v1.engine.step_sync.messages import (
    PROTOCOL_VERSION,
    TO_PARTICIPANT,
    Abort,
    Counters,
    GroupState,
    RankState,
    open_frames,
)
from vllm_disagg.wire.logs import RateLimitedLog

logger = init_logger(__name__)


class Received(NamedTuple):
    """What an accepted frame means to the engine."""

    grant: int | None  # the step delivered, when it grew
    group: (
        GroupState | None
    )  # the new group state, when its phase, members or ack changed


class ParticipantCore:
    def __init__(
        self, config: StepSyncConfig, dp_rank: int, incarnation: str, secret: bytes
    ):
        self.config = config
        self.dp_rank = dp_rank
        self.incarnation = incarnation
        self._secret = secret
        # Network half: what the coordinator said, and whether the group failed.
        self.delivered = 0
        self.group: GroupState | None = None
        self.failed: str | None = None
        self.stalled: str | None = (
            None  # the failure, when it is this rank's engine stuck
        )
        # Engine half.
        self.local_step = 0
        self.coord_step = 0
        self.requested = 0
        self.dummy_steps = 0
        self.forward_steps = 0
        self.intent = 0
        self.want_pause = False
        self.pause_ready = False
        self.leaving = False
        self.left = False
        # Set by the engine once its busy loop runs: before that (loading the
        # model) it cannot run the passes it owes, and that is no failure.
        self.watch_progress = False
        # Between begin_forward and the engine thread's next question (it
        # asks steps_owed after every pass): inside a forward pass.
        self.in_pass = False
        self.counters = Counters(
            "requests_sent",
            "grants_received",
            "malformed_messages",
            "grant_waits",
            "resends",
        )
        self._log_prefix = f"step sync rank {dp_rank}"
        self._log = RateLimitedLog(logger, REJECT_LOG_INTERVAL_S)
        # The latest state the engine half published (the network half adds
        # seq and local_step when it sends it).
        self.state = self._snapshot()
        # Network-half send bookkeeping: the last sequence number used, and
        # the first one that carried the current state (an acknowledgement
        # must reach it before the state counts as delivered).
        self._seq = 0
        self.state_first_seq = 1
        self.last_sent_state: RankState | None = None
        self._sent_state: RankState | None = None
        self._last_sent = 0.0
        self._last_heard = 0.0
        self._watch = ProgressWatch(config, dp_rank)

    # --- engine half ---

    @property
    def steps_owed(self) -> int:
        """Forward passes this rank still owes the group (dummy if no work)."""
        return max(0, self.coord_step - self.local_step)

    def observe_grant(self, step: int) -> None:
        if step > self.coord_step:
            self.coord_step = step

    def begin_forward(self, dummy: bool, passes_after: int | None = None) -> int:
        """Account for the forward pass about to run; return its step number.

        A real pass may run ahead of the grant: the coordinator is asked for
        ``lookahead`` steps past it before the remaining grant drops below the
        renewal margin. ``passes_after`` is the most passes this rank's known work
        can still use after this one (None: unknown, e.g. work waits in a queue);
        the request goes no further than that, so a drain whose end the rank can
        see coming leaves the group no dummy passes to run.
        """
        self.local_step += 1
        self.in_pass = True
        if dummy:
            self.dummy_steps += 1
            return self.local_step
        self.forward_steps += 1
        if self._horizon - self.local_step < self.config.renew_margin:
            self._request_steps(self.local_step + self._ahead(passes_after))
        return self.local_step

    def request_ahead(self, passes: int | None = None) -> int | None:
        """Work arrived: ask for the next ``lookahead`` steps (at most ``passes``, the
        most the known work can use, when known) unless this rank holds a grant (or a
        request) beyond its last pass; return the step to wait for, if it asked."""
        if self._horizon <= self.local_step:
            self._request_steps(self.local_step + max(1, self._ahead(passes)))
            return self.local_step + 1
        return None

    def _ahead(self, passes: int | None) -> int:
        """How many steps past the current one to ask for: the look-ahead, adapted
        down to the passes the rank's work can still use."""
        lookahead = self.config.lookahead
        return lookahead if passes is None else max(0, min(lookahead, passes))

    def set_pause_intent(self, pause: bool) -> int:
        self.intent += 1
        self.want_pause = pause
        self.pause_ready = False
        self.publish()
        return self.intent

    def set_pause_ready(self) -> None:
        if self.want_pause and not self.pause_ready:
            self.pause_ready = True
            self.publish()

    def set_leaving(self) -> None:
        if not self.leaving:
            self.leaving = True
            self.publish()

    def set_left(self) -> RankState:
        """Left the busy loop; returns the final state to see acknowledged."""
        self.left = True
        self.publish()
        return self.state

    def publish(self) -> None:
        self.state = self._snapshot()

    @property
    def _horizon(self) -> int:
        """Last step granted or already asked for: passes up to it need no request."""
        return max(self.requested, self.coord_step)

    def _request_steps(self, step: int) -> None:
        if step <= self._horizon:
            return  # granted or asked for already: nothing new to say
        self.requested = step
        self.counters.inc("requests_sent")
        self.publish()

    def _snapshot(self) -> RankState:
        cfg = self.config
        return RankState(
            PROTOCOL_VERSION,
            self.dp_rank,
            cfg.dp_size,
            cfg.lookahead,
            self.incarnation,
            1,
            self.requested,
            self.local_step,
            self.intent,
            self.want_pause,
            self.pause_ready,
            self.leaving,
            self.left,
        )

    # --- network half ---

    def acknowledged(self, state: RankState) -> bool:
        """``state`` went out and the coordinator confirmed it."""
        group = self.group
        return (
            self.last_sent_state is state
            and group is not None
            and group.ack_seq >= self.state_first_seq
        )

    def start(self, now: float) -> RankState:
        """The first message; the coordinator's silence counts from ``now``."""
        self._last_heard = now
        return self._next_message(now)

    def on_frames(self, frames: list[bytes], now: float) -> Received | None:
        """A frame from the coordinator; None when it was dropped."""
        msg, why = open_frames(self._secret, TO_PARTICIPANT, frames)
        if msg is None:
            self.counters.inc("malformed_messages")
            self._log.warning(why, "%s: dropped frame: %s", self._log_prefix, why)
            return None
        if isinstance(msg, Abort):
            self._last_heard = now
            self._fail(f"step sync coordinator aborted the DP group: {msg.reason}")
            return Received(None, None)
        previous = self.group
        if previous is not None and msg.seq <= previous.seq:
            self.counters.inc("malformed_messages")
            return None
        self._last_heard = now
        self.counters.inc("grants_received")
        self.group = msg
        grew = msg.step > self.delivered
        self.delivered = max(self.delivered, msg.step)
        changed = previous is None or (
            (msg.phase, msg.phase_step, msg.members, msg.intent_ack)
            != (
                previous.phase,
                previous.phase_step,
                previous.members,
                previous.intent_ack,
            )
        )
        return Received(msg.step if grew else None, msg if changed else None)

    def on_tick(self, now: float) -> RankState | None:
        """The message to send now, if any; fails the group when the coordinator was
        silent or this rank cannot make progress for ``peer_timeout_s``."""
        state = self.state
        msg = None
        if state is not self._sent_state or self._needs_resend(now - self._last_sent):
            if state is self._sent_state:
                self.counters.inc("resends")
            msg = self._next_message(now)
        cfg = self.config
        if now - self._last_heard > cfg.peer_timeout_s:
            self._fail(
                f"step sync coordinator silent for {now - self._last_heard:.1f}s "
                f"(step_sync_peer_timeout_s={cfg.peer_timeout_s})"
            )
        elif stalled := self._watch.check(
            self.local_step, self.delivered, self.watch_progress, now, self.in_pass
        ):
            self.stalled = stalled
            self._fail(stalled)
        return msg

    def _needs_resend(self, since_sent: float) -> bool:
        if since_sent >= self.config.heartbeat_interval_s:
            return True
        if since_sent < self.config.resend_interval_s:
            return False
        group = self.group
        unacked = group is None or group.ack_seq < self.state_first_seq
        waiting = self.delivered < max(self.requested, self.local_step)
        return unacked or waiting

    def _next_message(self, now: float) -> RankState:
        state = self.state
        self._seq += 1
        if state is not self.last_sent_state:
            self.state_first_seq, self.last_sent_state = self._seq, state
        self._sent_state, self._last_sent = state, now
        return msgspec.structs.replace(state, seq=self._seq, local_step=self.local_step)

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason


# A rank inside one forward pass is slow, not gone: it owes the next passes
# only once this one ends. A pass may take this many times the peer timeout
# before the group reports it stuck (a hung kernel or collective): on a CPU
# host whose pinned OpenMP teams contend, a healthy pass of the tiny MoE took
# more than 10 s, and the group used to fail "owes passes but ran none".
PASS_TIMEOUT_FACTOR = 10


class ProgressWatch:
    """Notices a rank that cannot make progress: it owes passes and runs
    none, or it ran a pass nobody granted and the grant never comes. Either
    means a collective is (or soon will be) stuck; report it rather than hang.
    A rank still inside a pass gets ``PASS_TIMEOUT_FACTOR`` times as long.
    """

    def __init__(self, config: StepSyncConfig, dp_rank: int):
        self.config = config
        self.dp_rank = dp_rank
        self._since: float | None = None
        self._mark: tuple[int, int] | None = None

    def check(
        self,
        local: int,
        granted: int,
        watching: bool,
        now: float,
        in_pass: bool = False,
    ) -> str | None:
        stuck = watching and local != granted
        mark = (local, granted)
        if not stuck or mark != self._mark:
            self._mark, self._since = mark, (now if stuck else None)
            return None
        timeout = self.config.peer_timeout_s
        slow_pass = in_pass and local < granted
        limit = timeout * PASS_TIMEOUT_FACTOR if slow_pass else timeout
        if now - self._since <= limit:
            return None
        waited = now - self._since
        if slow_pass:
            return (
                f"DP rank {self.dp_rank} has been in forward pass {local} for "
                f"{waited:.1f}s and owes passes up to {granted} (a kernel or "
                f"collective is stuck; limit {PASS_TIMEOUT_FACTOR} x "
                f"step_sync_peer_timeout_s={timeout})"
            )
        if local > granted:
            return (
                f"DP rank {self.dp_rank} ran pass {local} but the group granted only "
                f"up to {granted} for {waited:.1f}s "
                f"(step_sync_peer_timeout_s={timeout})"
            )
        return (
            f"DP rank {self.dp_rank} owes passes {local + 1}..{granted} but ran none "
            f"for {waited:.1f}s (its engine is stuck or asleep; "
            f"step_sync_peer_timeout_s={timeout})"
        )
