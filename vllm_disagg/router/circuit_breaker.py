"""One instance's circuit breaker: closed, open or half-open.

``failure_threshold`` consecutive failures open it: the instance gets no
requests for ``cooldown_s``. Then it is half-open: one request (the trial)
may go; a success closes it, a failure opens it again. Every change of state
goes through :meth:`CircuitBreaker._transition`, which logs and counts it, so
what a breaker did is seen in one place.

Plain Python, no clock of its own: the caller passes ``now`` (the registry's
injectable clock), so tests drive cool-downs without sleeping.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failure_threshold: int = 3  # consecutive failures that open the breaker
    cooldown_s: float = 10.0  # how long an open breaker keeps its instance out


# Told (breaker, old state, new state) after each transition; the registry
# counts them (``breaker_opens`` on /metrics).
TransitionHook = Callable[["CircuitBreaker", BreakerState, BreakerState], None]


class CircuitBreaker:
    """The breaker of one instance; ``label`` names it in log lines."""

    def __init__(
        self,
        config: BreakerConfig | None = None,
        label: str = "instance",
        on_transition: TransitionHook | None = None,
    ) -> None:
        self.config = config or BreakerConfig()
        self.label = label
        self.on_transition = on_transition
        self.consecutive_failures = 0
        self.opened_at: float | None = None  # clock time of the last opening
        # A request is out to a half-open instance: no second one until it ends.
        self.trial_in_flight = False
        self._state = BreakerState.CLOSED

    def state(self, now: float) -> BreakerState:
        """The state at ``now``: an open breaker whose cool-down is over is
        half-open (the transition happens when it is first looked at)."""
        if (
            self._state is BreakerState.OPEN
            and self.opened_at is not None
            and now - self.opened_at >= self.config.cooldown_s
        ):
            self._transition(BreakerState.HALF_OPEN, now)
        return self._state

    def admits(self, now: float) -> bool:
        """Whether a new request may go to the instance now."""
        if self._state is BreakerState.CLOSED:  # the common case, per request
            return True
        state = self.state(now)
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self.trial_in_flight
        )

    def request_started(self, now: float) -> None:
        """A request went out: while half-open, it is the one trial."""
        if self.state(now) is BreakerState.HALF_OPEN:
            self.trial_in_flight = True

    def request_ended(self) -> None:
        """A request to the instance ended: the trial slot is free again (a
        trial that ended with no verdict, e.g. the client left, gives its
        place to the next request)."""
        self.trial_in_flight = False

    def record(self, ok: bool, now: float) -> None:
        """What the instance did: a success closes the breaker from any state;
        a failure opens it when half-open, or when closed and it is the
        ``failure_threshold``-th in a row."""
        if ok:
            self.consecutive_failures = 0
            if self._state is not BreakerState.CLOSED:
                self._transition(BreakerState.CLOSED, now)
            return
        self.consecutive_failures += 1
        state = self.state(now)
        if state is BreakerState.HALF_OPEN or (
            state is BreakerState.CLOSED
            and self.consecutive_failures >= self.config.failure_threshold
        ):
            self._transition(BreakerState.OPEN, now)

    def trip(self, now: float) -> None:
        """Open now, whatever the count (an instance that refused a
        connection and has no heartbeat to come back with); an open breaker
        starts its cool-down again."""
        self._transition(BreakerState.OPEN, now)

    def _transition(self, new: BreakerState, now: float) -> None:
        """The one place the state changes: logged and counted. Opening an
        open breaker restarts its cool-down and counts as an opening."""
        old = self._state
        self._state = new
        if new is BreakerState.OPEN:
            self.opened_at = now
            logger.warning(
                "%s: circuit breaker open for %.1fs after %d failure(s)",
                self.label,
                self.config.cooldown_s,
                self.consecutive_failures,
            )
        elif new is BreakerState.HALF_OPEN:
            logger.info("%s: circuit breaker half-open: one trial request", self.label)
        else:
            self.opened_at = None
            logger.info("%s: circuit breaker closed", self.label)
        if self.on_transition is not None:
            self.on_transition(self, old, new)
