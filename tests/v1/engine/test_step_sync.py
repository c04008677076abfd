"""Coordinator/Participant protocol with no vLLM: real ZMQ sockets on loopback."""

from __future__ import annotations

import queue
import random
import threading
import time

import msgspec
import pytest
import zmq

from vllm_disagg.errors import ConfigError
from vllm_disagg.v1.engine.step_sync import (
    Coordinator,
    GroupPaused,
    GroupResumed,
    Participant,
    Register,
    RequestSteps,
    StepSyncConfig,
)

DEADLINE_S = 20.0


def wait_until(predicate, timeout_s=DEADLINE_S, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class SimEngine:
    """A stand-in engine thread: real work first, then dummy passes while owed."""

    def __init__(self, config, rank, address, work_steps, start_delay_s=0.0):
        self.events: queue.Queue = queue.Queue()
        self.failures: list[str] = []
        self.part = Participant(
            config,
            rank,
            address,
            on_grant=lambda step: self.events.put(("grant", step)),
            on_failure=lambda reason: self.events.put(("fail", reason)),
        )
        self.work_steps = work_steps
        self.start_delay_s = start_delay_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _drain(self, block: bool):
        try:
            kind, value = self.events.get(timeout=0.05) if block else self.events.get_nowait()
        except queue.Empty:
            return
        if kind == "grant":
            self.part.observe_grant(value)
        else:
            self.failures.append(value)

    def _loop(self):
        time.sleep(self.start_delay_s)
        while not self.stop.is_set():
            while not self.events.empty():
                self._drain(block=False)
            if self.work_steps > 0:
                self.part.begin_forward(dummy=False)
                self.work_steps -= 1
                time.sleep(0.002)
            elif self.part.steps_owed:
                self.part.begin_forward(dummy=True)
                time.sleep(0.002)
            else:
                self._drain(block=True)

    def start(self):
        self.part.start()
        self.thread.start()
        return self

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.part.close()


@pytest.fixture
def group():
    made = []

    def make(dp_size, work, lookahead=2, timeout_s=10.0, delays=None):
        config = StepSyncConfig(dp_size=dp_size, lookahead=lookahead, peer_timeout_s=timeout_s)
        coord = Coordinator(config, "tcp://127.0.0.1:0").start()
        engines = [
            SimEngine(config, r, coord.address, work[r], (delays or [0] * dp_size)[r]).start()
            for r in range(dp_size)
        ]
        made.append((coord, engines))
        return coord, engines

    yield make
    for coord, engines in made:
        for engine in engines:
            engine.close()
        coord.close()


def _settled(coord, engines):
    return all(e.work_steps == 0 and e.part.local_step == coord.step for e in engines)


@pytest.mark.parametrize("lookahead", [1, 2, 8])
def test_every_rank_runs_the_same_number_of_passes(group, lookahead):
    rng = random.Random(lookahead)
    work = [rng.randint(0, 60) for _ in range(4)]
    work[1] = 75  # one rank clearly busiest
    coord, engines = group(4, work, lookahead=lookahead, delays=[0, 0.05, 0.02, 0])
    wait_until(lambda: _settled(coord, engines), what="all ranks at the coordinator step")
    time.sleep(0.2)  # nothing further may happen once work has drained
    steps = {e.part.local_step for e in engines}
    assert steps == {coord.step}
    for engine, w in zip(engines, work):
        assert engine.part.forward_steps == w
        assert engine.part.forward_steps + engine.part.dummy_steps == coord.step
    # Wasted passes after the busiest rank drained are bounded by the lease.
    assert max(work) <= coord.step <= max(work) + lookahead
    assert not any(e.failures for e in engines)


def test_idle_group_runs_nothing(group):
    coord, engines = group(3, [0, 0, 0])
    wait_until(lambda: coord.registered == [0, 1, 2], what="registration")
    time.sleep(0.3)
    assert coord.step == 0
    assert all(e.part.local_step == 0 for e in engines)


def test_work_on_one_rank_wakes_the_others(group):
    coord, engines = group(2, [0, 0])
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    engines[1].work_steps = 10  # a request lands on rank 1 only
    engines[1].events.put(("grant", 0))  # wake its loop, as an ADD request would
    wait_until(lambda: _settled(coord, engines), what="rank 0 to follow rank 1")
    assert engines[0].part.dummy_steps == coord.step >= 10
    # Renewal is pipelined: far fewer requests than steps.
    assert engines[1].part.counters.snapshot()["requests_sent"] <= 10 // 2 + 1


def _raw_dealer(address, identity=b"intruder"):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def test_malformed_and_foreign_messages_are_counted_not_fatal(group):
    coord, engines = group(2, [0, 0])
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    enc = msgspec.msgpack.Encoder()
    bad = _raw_dealer(coord.address)
    try:
        bad.send(b"\xff\x00garbage")
        bad.send(enc.encode({"not": "a message"}))
        bad.send(enc.encode(RequestSteps(dp_rank=1, step=5)))  # not registered as rank 1
        bad.send(enc.encode(RequestSteps(dp_rank=7, step=5)))  # no such rank
        bad.send(enc.encode(Register(dp_rank=0, dp_size=2, lookahead=99, incarnation="x")))
        bad.send(b"x" * 10_000)  # over the size bound: dropped by ZMQ itself
        wait_until(
            lambda: coord.counters.snapshot()["malformed_messages"] >= 5, what="rejections"
        )
    finally:
        bad.close(linger=0)
    assert coord.step == 0
    # The group still works afterwards.
    engines[0].work_steps = 5
    engines[0].events.put(("grant", 0))
    wait_until(lambda: _settled(coord, engines), what="group to keep working")
    assert coord.step >= 5


def test_out_of_range_step_request_is_rejected(group):
    coord, engines = group(2, [0, 0], lookahead=2)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    # A registered rank asking far beyond its lease is a protocol violation.
    engines[0].part._outbox_tx.send(msgspec.msgpack.encode(RequestSteps(0, 10**9)))
    wait_until(lambda: coord.counters.snapshot()["malformed_messages"] >= 1, what="rejection")
    assert coord.step == 0
    # Duplicate and stale requests do not move the coordinator step.
    for step in (3, 3, 1, 2):
        engines[0].part._outbox_tx.send(msgspec.msgpack.encode(RequestSteps(0, step)))
    wait_until(lambda: coord.counters.snapshot()["requests_received"] >= 5, what="requests")
    assert coord.step == 3


def test_coordinator_death_fails_participants_fast(group):
    coord, engines = group(2, [0, 0], timeout_s=0.5)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    started = time.monotonic()
    coord.close()
    wait_until(lambda: all(e.failures for e in engines), timeout_s=5, what="failure reports")
    assert time.monotonic() - started < 3
    assert "coordinator silent" in engines[0].failures[0]


def test_participant_death_aborts_the_group(group):
    failures = []
    coord, engines = group(2, [0, 0], timeout_s=0.5)
    coord.on_failure = failures.append
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    engines[1].close()  # rank 1's process is gone
    wait_until(lambda: failures and engines[0].failures, timeout_s=5, what="abort")
    assert "DP rank 1" in failures[0]
    assert "aborted the DP group" in engines[0].failures[0]


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"dp_size": 2, "lookahead": 0}, "step_sync_lookahead"),
        ({"dp_size": 2, "lookahead": "4"}, "step_sync_lookahead"),
        ({"dp_size": 2, "peer_timeout_s": 0}, "step_sync_peer_timeout_s"),
        ({"dp_size": 0}, "dp_size"),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        StepSyncConfig(**kwargs)


class _Recorder:
    """A participant whose grants and phase events are only recorded."""

    def __init__(self, config, rank, address):
        self.grants: list[int] = []
        self.phases: list[object] = []
        self.part = Participant(
            config,
            rank,
            address,
            on_grant=self.grants.append,
            on_failure=lambda reason: None,
            on_phase=self.phases.append,
        ).start()

    def kinds(self) -> list[str]:
        return [type(event).__name__ for event in self.phases]


@pytest.fixture
def recorders():
    made = []

    def make(dp_size):
        config = StepSyncConfig(dp_size=dp_size, lookahead=2, peer_timeout_s=10.0)
        coord = Coordinator(config, "tcp://127.0.0.1:0").start()
        parts = [_Recorder(config, r, coord.address) for r in range(dp_size)]
        made.append((coord, parts))
        wait_until(lambda: coord.registered == list(range(dp_size)), what="registration")
        return coord, parts

    yield make
    for coord, parts in made:
        for rec in parts:
            rec.part.close()
        coord.close()


def test_pause_completes_only_when_every_rank_paused_at_one_step(recorders):
    coord, (r0, r1) = recorders(2)
    for _ in range(3):
        r0.part.begin_forward(dummy=False)
    r0.part.request_pause()
    time.sleep(0.3)
    assert r0.phases == [] and r1.phases == [], "paused before every rank agreed"
    r1.part.request_pause()
    wait_until(lambda: r0.phases and r1.phases, what="GroupPaused on both ranks")
    assert r0.phases == r1.phases == [GroupPaused(coord.step)]
    # The final step covers every step a rank asked for before pausing.
    assert coord.step >= 3

    # Resume is a barrier too: nobody schedules until every rank resumed.
    r0.part.request_resume()
    time.sleep(0.3)
    assert r0.kinds() == ["GroupPaused"]
    r1.part.request_resume()
    wait_until(lambda: len(r0.phases) == len(r1.phases) == 2, what="GroupResumed")
    assert r0.phases[1] == r1.phases[1] == GroupResumed()


def test_step_request_from_a_paused_group_is_granted_and_counted(recorders):
    """A stale wake-up can never deadlock: a paused rank that still asks for a
    step gets it (its peers run dummies), and the violation is counted."""
    coord, (r0, r1) = recorders(2)
    r0.part.request_pause()
    r1.part.request_pause()
    wait_until(lambda: r0.phases and r1.phases, what="GroupPaused")
    r0.part.begin_forward(dummy=False)
    wait_until(lambda: r1.grants and r1.grants[-1] >= 1, what="grant to the peer")
    assert coord.counters.snapshot()["pause_violations"] == 1


def test_rank_resuming_before_the_group_paused_keeps_the_group_running(recorders):
    coord, (r0, r1) = recorders(2)
    r0.part.request_pause()
    r0.part.request_resume()  # e.g. the pause call was cancelled
    wait_until(lambda: r0.phases == [GroupResumed()], what="r0 resumed alone")
    r1.part.request_pause()
    time.sleep(0.3)
    assert r1.phases == [], "group paused without rank 0"


def test_request_ahead_wakes_peers_before_the_first_pass(recorders):
    """Work arriving at an idle rank asks for ``lookahead`` steps at once, so
    the peers start their dummy passes while it is still scheduling."""
    coord, (r0, r1) = recorders(2)
    r1.part.request_ahead()
    # It returned once its grant was back (one round trip): the peers have it too.
    assert coord.step == 2 and r1.part.stats["grant_waits"] == 1
    wait_until(lambda: r0.grants and r1.grants, what="grants from request_ahead")
    assert r0.grants[-1] == r1.grants[-1] == 2
    # Holding an unused grant, a second call asks for nothing more, and the
    # first pass finds its grant already there.
    r1.part.observe_grant(r1.grants[-1])
    sent = r1.part.stats["requests_sent"]
    r1.part.request_ahead()
    r1.part.begin_forward(dummy=False)
    assert r1.part.stats["requests_sent"] == sent
    assert r1.part.stats["grant_waits"] == 1


def test_only_an_ungranted_pass_waits_for_its_grant(recorders):
    coord, (r0, r1) = recorders(2)
    # Waking pass: nobody granted step 1 yet, so it waits for the round trip.
    r1.part.begin_forward(dummy=False)
    assert r1.part.stats["grant_waits"] == 1
    assert r1.grants and r1.grants[-1] >= 1, "returned before its grant arrived"
    r1.part.observe_grant(r1.grants[-1])
    # Steady work: renewals go out ahead of need, so later passes never wait.
    for _ in range(20):
        r1.part.begin_forward(dummy=False)
        time.sleep(0.005)  # a pass takes longer than a loopback round trip
        r1.part.observe_grant(r1.grants[-1])
    assert r1.part.stats["grant_waits"] == 1
    wait_until(lambda: r0.grants and r0.grants[-1] == coord.step >= 21, what="peer grants")


def test_options_come_from_additional_config():
    config = StepSyncConfig.from_additional_config(
        {"step_sync_lookahead": 4, "step_sync_peer_timeout_s": 2.5, "other": 1}, dp_size=2
    )
    assert (config.lookahead, config.peer_timeout_s) == (4, 2.5)
    assert StepSyncConfig.from_additional_config({}, dp_size=2).lookahead == 2
    with pytest.raises(ConfigError, match="step_sync_lookahead, step_sync_peer_timeout_s"):
        StepSyncConfig.from_additional_config({"step_sync_lookahed": 4}, dp_size=2)
    with pytest.raises(ConfigError, match="step_sync_peer_timeout_s"):
        StepSyncConfig.from_additional_config({"step_sync_peer_timeout_s": True}, dp_size=2)
