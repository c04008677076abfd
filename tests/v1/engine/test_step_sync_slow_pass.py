"""A rank inside one slow forward pass is slow, not stuck (issue 27).

With vLLM's CPU defaults several servers on one host pin their OpenMP teams
to the same cores, and a healthy forward pass of the tiny MoE took more than
10 s; the progress watch counted that as "owes passes .. but ran none" and
failed the whole DP group. A rank inside a pass now gets
PASS_TIMEOUT_FACTOR x step_sync_peer_timeout_s; one that runs none still
fails after step_sync_peer_timeout_s.
"""

from __future__ import annotations

from vllm_disagg.v1.engine.step_sync import StepSyncConfig
from vllm_disagg.v1.engine.step_sync.participant_core import (
    PASS_TIMEOUT_FACTOR,
    ProgressWatch,
)

CONFIG = StepSyncConfig(dp_size=2, peer_timeout_s=1.0)


def _first_report(watch: ProgressWatch, in_pass: bool, until: float) -> float | None:
    """Step the clock by 0.1 s: when the watch first reports rank 1, which ran
    pass 5 and owes passes up to 7."""
    now = 0.0
    while now < until:
        if watch.check(5, 7, True, now, in_pass) is not None:
            return now
        now += 0.1
    return None


def test_a_rank_that_runs_no_pass_fails_after_the_peer_timeout():
    watch = ProgressWatch(CONFIG, 1)
    at = _first_report(watch, in_pass=False, until=5.0)
    assert at is not None and 1.0 < at < 1.3


def test_a_rank_inside_a_slow_pass_gets_longer():
    watch = ProgressWatch(CONFIG, 1)
    limit = CONFIG.peer_timeout_s * PASS_TIMEOUT_FACTOR
    at = _first_report(watch, in_pass=True, until=limit + 1.0)
    assert at is not None and limit < at < limit + 0.3
    reason = ProgressWatch(CONFIG, 1)
    reason.check(5, 7, True, 0.0, True)
    message = reason.check(5, 7, True, limit + 0.5, True)
    assert "has been in forward pass 5" in message and "stuck" in message


def test_a_pass_ahead_of_its_grant_is_not_given_longer():
    """A rank that ran a pass nobody granted waits for the grant, not for a
    kernel: the peer timeout applies."""
    watch = ProgressWatch(CONFIG, 1)
    watch.check(7, 5, True, 0.0, True)
    assert watch.check(7, 5, True, 1.2, True) is not None
