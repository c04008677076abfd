"""Pause, resume, sleep, wake and shutdown are group phases of the real
``StepSyncDPEngineCoreProc`` (its methods and upstream's ``pause_scheduler``,
``sleep``, ``wake_up``, ``_handle_shutdown``), driven over a real
Coordinator/Participant pair; only the scheduler, the executor and the
collectives are simulated."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from step_sync_helpers import EngineThread, make_engine, wait_until
from vllm.v1.engine.core import EngineShutdownState

from vllm_disagg.v1.engine import core as engine_core
from vllm_disagg.v1.engine.core import PausePhase
from vllm_disagg.v1.engine.step_sync import (
    Coordinator,
    GroupPhase,
    StepSyncConfig,
    new_group_secret,
)


class Group:
    def __init__(self, dp_size=2, timeout_s=5.0, shutdown_timeout=0):
        self.config = StepSyncConfig(
            dp_size=dp_size, lookahead=2, peer_timeout_s=timeout_s
        )
        secret = new_group_secret()
        self.failures: list[str] = []
        self.coord = Coordinator(
            self.config, "tcp://127.0.0.1:0", secret, on_failure=self.failures.append
        ).start()
        self.engines = [
            make_engine(self.config, r, self.coord.address, secret, shutdown_timeout)
            for r in range(dp_size)
        ]
        for engine in self.engines:
            engine.step_sync.wait_for_group(5)
        passes = {r: 0 for r in range(dp_size)}
        self.threads = [EngineThread(e, passes).start() for e in self.engines]
        self.closed = False

    def close(self):
        """Idempotent: a test may close its group early, the fixture again."""
        if self.closed:
            return
        self.closed = True
        for engine in self.engines:
            engine.shutdown_state = EngineShutdownState.REQUESTED
        for thread in self.threads:
            thread.thread.join(10)
        for engine in self.engines:
            engine.step_sync.close(timeout_s=0.5)
        self.coord.close(timeout_s=1)

    def steps(self):
        return [e.step_sync.local_step for e in self.engines]

    def quiet(self):
        """Every rank ran exactly the coordinator's steps and has nothing due."""
        return all(
            e.step_sync.local_step == self.coord.step
            and e.step_sync.coord_step == self.coord.step
            and not e.has_work()
            for e in self.engines
        )

    def assert_healthy(self):
        for thread in self.threads:
            assert thread.hung_at is None, (
                f"rank hung in the collective of pass {thread.hung_at}"
            )
            assert thread.error is None, thread.error
            assert thread.ran_while_asleep == 0
        assert not self.failures


@pytest.fixture
def make_group():
    made = []

    def make(**kwargs):
        group = Group(**kwargs)
        made.append(group)
        return group

    yield make
    for group in made:
        group.close()


def _futures(thread) -> list[Future]:
    return [r for _, r in thread.results if isinstance(r, Future)]


OPS = [
    "pause_keep",
    "pause_abort",
    "pause_wait",
    "resume",
    "sleep0",
    "sleep1",
    "wake",
    "work",
]


def _apply(thread, op):
    if op == "pause_keep":
        thread.call("pause_scheduler", mode="keep", clear_cache=False)
    elif op == "pause_abort":
        thread.call("pause_scheduler", mode="abort", clear_cache=False)
    elif op == "pause_wait":
        thread.call("pause_scheduler", mode="wait", clear_cache=False)
    elif op == "resume":
        thread.call("resume_scheduler")
    elif op == "sleep0":
        thread.call("sleep", level=0, mode="keep")
    elif op == "sleep1":
        thread.call("sleep", level=1, mode="keep")
    elif op == "wake":
        thread.call("wake_up")
    elif op == "work":  # a request arrives (on the engine thread, as an ADD would)
        thread.call(thread.engine.scheduler.add_work, 3)


@settings(
    max_examples=15,
    deadline=None,
    # The same examples on every run (CI must be reproducible), and no
    # shrinking: each example runs real threads for seconds, so shrinking a
    # failure could take longer than the CI run; the failing schedule is
    # printed as it is.
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    schedule=st.lists(
        st.tuples(
            st.integers(0, 1), st.sampled_from(OPS), st.sampled_from([0, 0.001, 0.02])
        ),
        min_size=1,
        max_size=10,
    )
)
def test_any_interleaving_of_pause_resume_sleep_and_wake_ends_agreed(
    make_group, schedule
):
    # One fixture serves every example: close each example's group at its end,
    # or 15 groups' threads pile up and slow the later examples down.
    group = make_group()
    try:
        _run_schedule_and_check(group, schedule)
    finally:
        group.close()


def _run_schedule_and_check(group, schedule):
    for thread in group.threads:  # unknown input types are ignored by upstream
        thread.engine.input_queue.put_nowait(("wake", None))
    for rank, op, delay in schedule:
        _apply(group.threads[rank], op)
        time.sleep(delay)
    time.sleep(0.2)

    # Safety: nobody hung or failed, every rank at the coordinator's step
    # once things settle, and no rank contradicts the group's phase.
    wait_until(group.quiet, timeout_s=10, what=lambda: f"quiet group: {group.steps()}")
    group.assert_healthy()
    for engine in group.engines:
        phase = engine.step_sync.group.phase
        if engine.pause_phase == PausePhase.PAUSED:
            assert phase == GroupPhase.PAUSED
        if engine.pause_phase == PausePhase.RUNNING:
            assert phase == GroupPhase.RUNNING

    # Liveness: from wherever the sequence left the group, pausing every
    # rank completes every pending pause, and resuming every rank runs again.
    for thread in group.threads:
        thread.call("pause_scheduler", mode="keep", clear_cache=False)
    wait_until(
        lambda: all(f.done() for t in group.threads for f in _futures(t))
        and all(e.pause_phase == PausePhase.PAUSED for e in group.engines),
        timeout_s=10,
        what=lambda: (
            f"every pause to complete: {[e.pause_phase for e in group.engines]}"
        ),
    )
    assert group.coord.phase == GroupPhase.PAUSED
    for thread in group.threads:
        thread.call("wake_up")  # wakes a sleeping executor and resumes
    wait_until(
        lambda: all(e.pause_phase == PausePhase.RUNNING for e in group.engines),
        timeout_s=10,
        what=lambda: f"every rank to resume: {[e.pause_phase for e in group.engines]}",
    )
    part = group.engines[1].step_sync
    before = part.forward_steps
    _apply(group.threads[1], "work")
    # Work kept through earlier pauses runs too.
    wait_until(
        lambda: all(e.scheduler.work == e.scheduler.queued == 0 for e in group.engines)
        and part.forward_steps >= before + 3
        and group.quiet(),
        timeout_s=10,
        what=lambda: (
            f"work: forward {part.forward_steps - before}/3, steps {group.steps()}"
        ),
    )
    group.assert_healthy()
    # Errors are allowed only where upstream raises too: resume during a
    # pause that has not completed.
    for thread in group.threads:
        for name, result in thread.results:
            if isinstance(result, Exception):
                assert name in ("resume_scheduler", "wake_up"), (name, result)
                assert "pause is still in flight" in str(result) or "is asleep" in str(
                    result
                )


def test_resume_answers_once_every_rank_runs(make_group):
    """A client that awaited resume on every rank finds none paused (upstream's
    consensus is_scheduler_paused(), test_dp_pause_resume_basic): each rank's
    resume is answered only once the group runs again."""
    group = make_group()
    t0, t1 = group.threads
    for t in group.threads:
        t.call("pause_scheduler", mode="abort", clear_cache=False)
    wait_until(lambda: all(e.pause_phase == PausePhase.PAUSED for e in group.engines))
    t0.call("resume_scheduler")
    wait_until(lambda: t0.results and t0.results[-1][0] == "resume_scheduler")
    answer = t0.results[-1][1]
    assert isinstance(answer, Future)
    time.sleep(0.3)
    assert not answer.done()  # rank 1 has not resumed: the group is paused
    assert group.engines[0].is_scheduler_paused()
    t1.call("resume_scheduler")
    wait_until(
        lambda: answer.done()
        and all(f.done() for t in group.threads for f in _futures(t)),
        what=lambda: f"resumes: {[e.pause_phase for e in group.engines]}",
    )
    assert not any(e.is_scheduler_paused() for e in group.engines)
    group.assert_healthy()


def test_a_rank_pausing_again_before_its_peers_resumed_is_not_wedged(make_group):
    """The landed bug: rank 0 resumes and pauses again before rank 1's
    resume reaches the coordinator."""
    group = make_group()
    t0, t1 = group.threads
    for t in group.threads:
        t.call("pause_scheduler", mode="keep", clear_cache=False)
    wait_until(lambda: all(e.pause_phase == PausePhase.PAUSED for e in group.engines))
    t0.call("resume_scheduler")
    t0.call("pause_scheduler", mode="keep", clear_cache=False)
    t1.call("resume_scheduler")
    time.sleep(0.3)
    t1.call("pause_scheduler", mode="keep", clear_cache=False)
    wait_until(
        lambda: all(f.done() for t in group.threads for f in _futures(t))
        and all(e.pause_phase == PausePhase.PAUSED for e in group.engines),
        what=lambda: f"pauses: {[e.pause_phase for e in group.engines]}",
    )
    t0.call("resume_scheduler")
    t1.call("resume_scheduler")
    wait_until(lambda: all(e.pause_phase == PausePhase.RUNNING for e in group.engines))
    group.assert_healthy()
    assert not any(
        isinstance(r, Exception) for t in group.threads for _, r in t.results
    )


def test_a_sleeping_rank_never_spins_and_a_broken_pause_is_reported(make_group):
    group = make_group(timeout_s=1.0)
    for t in group.threads:
        t.call("sleep", level=1, mode="keep")
    wait_until(
        lambda: all(e.model_executor.is_sleeping for e in group.engines), what="sleep"
    )
    steps = group.steps()
    time.sleep(0.3)
    assert group.steps() == steps and all(not e.has_work() for e in group.engines)
    # A peer that breaks the pause (asks for steps while the group sleeps):
    # the sleeping rank neither runs nor spins; the stall is reported.
    group.engines[1].step_sync.begin_forward(dummy=False)
    wait_until(
        lambda: group.threads[0].error is not None, timeout_s=5, what="the report"
    )
    assert "its engine is stuck or asleep" in str(group.threads[0].error)
    assert group.threads[0].ran_while_asleep == 0
    group.threads[1].hung_at = None  # its simulated pass is the one left waiting
    group.failures.clear()


def _leave_together(group, work_on_rank0: int, ready_in_s: float = 0.0):
    e0, e1 = group.engines
    e0.scheduler.work = work_on_rank0
    e0.scheduler.ready_at = time.monotonic() + ready_in_s
    e0.input_queue.put_nowait(("wake", None))
    time.sleep(0.05)
    for engine in group.engines:  # SIGTERM reaches every engine
        engine.shutdown_state = EngineShutdownState.REQUESTED
        engine.input_queue.put_nowait(("wake", None))
    wait_until(
        lambda: all(t.exited or t.error or t.hung_at for t in group.threads),
        timeout_s=20,
        what="both ranks to leave the loop",
    )
    group.assert_healthy()
    assert all(t.exited for t in group.threads)
    assert e0.scheduler.work == 0, "in-flight work was lost"
    assert group.steps()[0] == group.steps()[1] == group.coord.phase_step
    assert group.coord.phase == GroupPhase.EXITING


def test_drain_shutdown_completes_the_busy_ranks_work_and_all_leave_at_one_step(
    make_group,
):
    group = make_group(shutdown_timeout=30)
    _leave_together(group, work_on_rank0=200)
    assert group.steps()[0] >= 200


def test_drain_shutdown_waits_for_a_rank_whose_work_waits_for_remote_kv(make_group):
    group = make_group(shutdown_timeout=30)
    _leave_together(group, work_on_rank0=20, ready_in_s=0.5)
    assert group.steps()[0] >= 20


def test_abort_shutdown_leaves_at_one_step(make_group):
    group = make_group(shutdown_timeout=0)
    _leave_together(group, work_on_rank0=200)


def test_a_rank_shut_down_alone_leaves_after_the_grace_and_the_peer_fails_fast(
    make_group, monkeypatch
):
    monkeypatch.setattr(engine_core, "EXIT_GRACE_S", 0.5)
    group = make_group(timeout_s=30, shutdown_timeout=0)
    e0, e1 = group.engines
    e1.shutdown_state = EngineShutdownState.REQUESTED  # only rank 1's server stopped
    e1.input_queue.put_nowait(("wake", None))
    wait_until(
        lambda: group.threads[1].exited, timeout_s=5, what="rank 1 to give up waiting"
    )
    e1.step_sync.close()  # what its shutdown() does: tell the group it left
    wait_until(
        lambda: group.threads[0].error is not None, timeout_s=5, what="rank 0 to fail"
    )
    assert "DP rank 1 left the group" in str(group.threads[0].error)
    group.failures.clear()
