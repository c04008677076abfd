"""CircuitBreaker: its states, the one transition function, what it counts."""

from __future__ import annotations

from vllm_disagg.router.circuit_breaker import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
)


def make(threshold: int = 2, cooldown_s: float = 10.0):
    seen: list[tuple[BreakerState, BreakerState]] = []
    breaker = CircuitBreaker(
        BreakerConfig(threshold, cooldown_s),
        "instance i (h:1)",
        lambda _, old, new: seen.append((old, new)),
    )
    return breaker, seen


def test_consecutive_failures_open_then_half_open_then_closed():
    breaker, seen = make()
    breaker.record(False, 0.0)
    assert breaker.state(0.0) is BreakerState.CLOSED and breaker.admits(0.0)
    breaker.record(False, 1.0)
    assert breaker.state(1.0) is BreakerState.OPEN and not breaker.admits(5.0)
    assert breaker.state(11.0) is BreakerState.HALF_OPEN and breaker.admits(11.0)
    breaker.request_started(11.0)  # the trial
    assert not breaker.admits(11.0)
    breaker.request_ended()
    breaker.record(True, 12.0)
    assert breaker.state(12.0) is BreakerState.CLOSED
    assert breaker.consecutive_failures == 0
    assert seen == [
        (BreakerState.CLOSED, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.CLOSED),
    ]


def test_a_failed_trial_reopens_and_a_success_in_between_resets_the_count():
    breaker, seen = make(threshold=2, cooldown_s=5.0)
    breaker.record(False, 0.0)
    breaker.record(True, 0.0)
    breaker.record(False, 0.0)
    assert breaker.state(0.0) is BreakerState.CLOSED and seen == []
    breaker.record(False, 0.0)
    breaker.record(False, 5.0)  # the trial failed
    assert breaker.state(5.0) is BreakerState.OPEN and breaker.opened_at == 5.0
    assert [new for _, new in seen] == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
    ]


def test_trip_opens_at_once_and_restarts_an_open_breakers_cooldown(caplog):
    breaker, seen = make(threshold=3, cooldown_s=5.0)
    with caplog.at_level("WARNING"):
        breaker.trip(0.0)
        breaker.trip(3.0)
    assert breaker.state(7.0) is BreakerState.OPEN
    assert breaker.state(8.0) is BreakerState.HALF_OPEN
    assert seen[:2] == [
        (BreakerState.CLOSED, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.OPEN),
    ]
    assert "instance i (h:1): circuit breaker open for 5.0s after 0 failure(s)" in (
        caplog.records[0].getMessage()
    )
