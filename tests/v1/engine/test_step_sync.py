"""Coordinator/Participant protocol with no vLLM: real ZMQ sockets on loopback."""

from __future__ import annotations

import random
import time

import pytest
from step_sync_helpers import settled as _settled
from step_sync_helpers import wait_until

from vllm_disagg.errors import ConfigError
from vllm_disagg.v1.engine.step_sync import (
    PROTOCOL_VERSION,
    TO_COORDINATOR,
    Coordinator,
    GroupPhase,
    Participant,
    RankState,
    StepSyncConfig,
    new_group_secret,
    seal,
)

# Where rank 0 runs the coordinator: its own thread, or its child process.
HOSTS = ["thread", "process"]


@pytest.mark.parametrize(
    ("lookahead", "host"), [(1, "thread"), (2, "thread"), (8, "thread"), (2, "process")]
)
def test_every_rank_runs_the_same_number_of_passes(group, lookahead, host):
    rng = random.Random(lookahead)
    work = [rng.randint(0, 60) for _ in range(4)]
    work[1] = 75  # one rank clearly busiest
    coord, engines = group(
        4, work, lookahead=lookahead, delays=[0, 0.05, 0.02, 0], host=host
    )
    wait_until(
        lambda: _settled(coord, engines), what="all ranks at the coordinator step"
    )
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


@pytest.mark.parametrize("host", HOSTS)
def test_work_on_one_rank_wakes_the_others(group, host):
    coord, engines = group(2, [0, 0], host=host)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    engines[1].add_work(10)  # a request lands on rank 1 only
    wait_until(lambda: _settled(coord, engines), what="rank 0 to follow rank 1")
    assert engines[0].part.dummy_steps == coord.step >= 10
    # Renewal is pipelined: far fewer requests than steps.
    assert engines[1].part.counters.snapshot()["requests_sent"] <= 10 // 2 + 1


def _seal(secret, msg):
    return seal(secret, TO_COORDINATOR, msg)


def _rank_state(rank, seq, requested=0, local_step=0, **overrides):
    fields = dict(
        version=PROTOCOL_VERSION,
        dp_rank=rank,
        dp_size=2,
        lookahead=2,
        incarnation="intruder",
        seq=seq,
        requested=requested,
        local_step=local_step,
        intent=0,
        want_pause=False,
        pause_ready=False,
        leaving=False,
        left=False,
    )
    fields.update(overrides)
    return RankState(**fields)


def test_out_of_range_step_request_is_rejected(group):
    coord, engines = group(2, [0, 0], lookahead=2)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    part = engines[0].part
    # A registered rank asking far beyond its lease is a protocol violation.
    part.core.requested = 10**9
    part._publish()
    wait_until(
        lambda: coord.counters.snapshot()["malformed_messages"] >= 1, what="rejection"
    )
    assert coord.step == 0
    # Asking within the lease, then repeating or lowering the ask, moves
    # the coordinator step once.
    for step in (3, 3, 1, 2):
        part.core.requested = step
        part._publish()
        time.sleep(0.05)
    wait_until(lambda: coord.step == 3, what="grant")
    time.sleep(0.2)
    assert coord.step == 3


@pytest.mark.parametrize("host", HOSTS)
def test_coordinator_shutdown_aborts_participants_at_once(group, host):
    """A coordinator that goes away tells its peers, so they fail in well
    under a second instead of after step_sync_peer_timeout_s."""
    coord, engines = group(2, [0, 0], timeout_s=30, host=host)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    started = time.monotonic()
    coord.close(abort_reason="DP rank 0 crashed")
    wait_until(
        lambda: all(e.failures for e in engines), timeout_s=15, what="failure reports"
    )
    assert time.monotonic() - started < 10  # far below the 30 s peer timeout
    assert "DP rank 0 crashed" in engines[1].failures[0]


def test_silent_coordinator_fails_participants_fast(group):
    coord, engines = group(2, [0, 0], timeout_s=0.5)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    started = time.monotonic()
    # Its thread stops answering and sends nothing, not even an Abort: what
    # a coordinator process that hangs or is SIGKILLed looks like.
    coord._deliver = lambda sends: False
    coord._stop.set()
    wait_until(
        lambda: all(e.failures for e in engines), timeout_s=15, what="failure reports"
    )
    assert time.monotonic() - started < 10
    assert "coordinator silent" in engines[0].failures[0]


@pytest.mark.parametrize("host", HOSTS)
def test_participant_death_aborts_the_group(group, host):
    coord, engines = group(2, [0, 0], timeout_s=0.5, host=host)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    engines[1].stop.set()
    engines[1].part._stop.set()  # the process is gone: no goodbye
    wait_until(
        lambda: coord.failures and engines[0].failures, timeout_s=5, what="abort"
    )
    assert "DP rank 1 silent" in coord.failures[0]
    assert "aborted the DP group" in engines[0].failures[0]


@pytest.mark.parametrize("host", HOSTS)
def test_a_rank_leaving_outside_an_agreed_exit_aborts_the_group(group, host):
    coord, engines = group(2, [0, 0], timeout_s=30, host=host)
    wait_until(lambda: coord.registered == [0, 1], what="registration")
    engines[1].part.close()  # says goodbye, but the group did not agree to exit
    wait_until(
        lambda: coord.failures and engines[0].failures, timeout_s=5, what="abort"
    )
    assert "DP rank 1 left the group" in coord.failures[0]


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
    """A participant whose grants and group states are only recorded."""

    def __init__(self, config, rank, address, secret):
        self.grants: list[int] = []
        self.states: list[object] = []
        self.part = Participant(
            config,
            rank,
            address,
            secret,
            on_grant=self.grants.append,
            on_failure=lambda reason: None,
            on_group=self.states.append,
        ).start()

    def phase(self):
        return self.part.group.phase


@pytest.fixture
def recorders():
    made = []

    def make(dp_size):
        config = StepSyncConfig(dp_size=dp_size, lookahead=2, peer_timeout_s=10.0)
        secret = new_group_secret()
        coord = Coordinator(config, "tcp://127.0.0.1:0", secret).start()
        parts = [_Recorder(config, r, coord.address, secret) for r in range(dp_size)]
        made.append((coord, parts))
        wait_until(
            lambda: coord.registered == list(range(dp_size)), what="registration"
        )
        for rec in parts:
            rec.part.wait_for_group(5)
        return coord, parts

    yield make
    for coord, parts in made:
        coord.close(timeout_s=1)
        for rec in parts:
            rec.part.close(timeout_s=0.5)


def _pause(rec):
    intent = rec.part.set_pause_intent(True)
    rec.part.set_pause_ready()
    return intent


def test_pause_completes_only_when_every_rank_paused_at_one_step(recorders):
    coord, (r0, r1) = recorders(2)
    for _ in range(3):
        r0.part.begin_forward(dummy=False)
    intent0 = _pause(r0)
    wait_until(lambda: r0.part.group.intent_ack == intent0, what="ack")
    assert r0.phase() == r1.phase() == GroupPhase.RUNNING, (
        "paused before every rank agreed"
    )
    intent1 = _pause(r1)
    wait_until(
        lambda: r0.phase() == r1.phase() == GroupPhase.PAUSED
        and r1.part.group.intent_ack == intent1,
        what="the group paused",
    )
    # The final step covers every step a rank asked for before pausing.
    assert r0.part.group.phase_step == r1.part.group.phase_step == coord.step >= 3

    # Resume is a barrier too: nobody schedules until every rank resumed.
    intent0 = r0.part.set_pause_intent(False)
    wait_until(lambda: r0.part.group.intent_ack == intent0, what="ack")
    assert r0.phase() == GroupPhase.PAUSED
    r1.part.set_pause_intent(False)
    wait_until(
        lambda: r0.phase() == r1.phase() == GroupPhase.RUNNING, what="the group resumed"
    )


def test_step_request_from_a_paused_group_is_granted_and_counted(recorders):
    """A stale wake-up can never deadlock: a paused rank that still asks for a
    step gets it (its peers run dummies), and the violation is counted."""
    coord, (r0, r1) = recorders(2)
    _pause(r0)
    _pause(r1)
    wait_until(lambda: r0.phase() == r1.phase() == GroupPhase.PAUSED, what="paused")
    r0.part.begin_forward(dummy=False)
    wait_until(lambda: r1.grants and r1.grants[-1] >= 1, what="grant to the peer")
    assert coord.counters.snapshot()["pause_violations"] == 1


def test_rank_resuming_before_the_group_paused_keeps_the_group_running(recorders):
    coord, (r0, r1) = recorders(2)
    _pause(r0)
    r0.part.set_pause_intent(False)  # e.g. the pause call was cancelled
    intent1 = _pause(r1)
    wait_until(lambda: r1.part.group.intent_ack == intent1, what="ack")
    time.sleep(0.2)
    assert coord.phase == GroupPhase.RUNNING, "group paused without rank 0"


def test_request_ahead_wakes_peers_before_the_first_pass(recorders):
    """Work arriving at an idle rank asks for ``lookahead`` steps at once, so
    the peers start their dummy passes while it is still scheduling."""
    coord, (r0, r1) = recorders(2)
    r1.part.request_ahead()
    # It waited for its grant (one round trip): the peers have it too.
    assert r1.part.stats["grant_waits"] == 1
    wait_until(lambda: coord.step == 2, what="the coordinator step")
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
    # (Not always: its wake-up message releases the GIL, and on a loaded
    # machine the network and coordinator threads can deliver the grant
    # before this thread checks for it; correct code then need not wait. It
    # waits at most MAX_GRANT_WAIT_S: it may also return first, which is
    # safe; the pass then waits for its peers instead.)
    r1.part.begin_forward(dummy=False)
    waking_waits = r1.part.stats["grant_waits"]
    assert waking_waits <= 1
    wait_until(lambda: r1.grants and r1.grants[-1] >= 1, what="the waking grant")
    r1.part.observe_grant(r1.grants[-1])
    # Steady work: renewals go out ahead of need, so later passes never wait.
    for _ in range(20):
        r1.part.begin_forward(dummy=False)
        # A pass takes longer than a loopback round trip (made deterministic
        # here, so that a loaded machine cannot turn it around).
        wait_until(
            lambda: r1.part.delivered >= r1.part.requested, what="renewal granted"
        )
        r1.part.observe_grant(r1.grants[-1])
    assert r1.part.stats["grant_waits"] == waking_waits
    wait_until(
        lambda: r0.grants and r0.grants[-1] == coord.step >= 21, what="peer grants"
    )


def test_options_come_from_additional_config():
    config = StepSyncConfig.from_additional_config(
        {"step_sync_lookahead": 4, "step_sync_peer_timeout_s": 2.5, "other": 1},
        dp_size=2,
    )
    assert (config.lookahead, config.peer_timeout_s) == (4, 2.5)
    assert StepSyncConfig.from_additional_config({}, dp_size=2).lookahead == 2
    with pytest.raises(
        ConfigError, match="step_sync_lookahead, step_sync_peer_timeout_s"
    ):
        StepSyncConfig.from_additional_config({"step_sync_lookahed": 4}, dp_size=2)
    with pytest.raises(ConfigError, match="step_sync_peer_timeout_s"):
        StepSyncConfig.from_additional_config(
            {"step_sync_peer_timeout_s": True}, dp_size=2
        )


def test_ipv6_loopback_group():
    config = StepSyncConfig(dp_size=2, lookahead=2, peer_timeout_s=5.0)
    secret = new_group_secret()
    coord = Coordinator(config, "tcp://[::1]:0", secret).start()
    parts = [
        Participant(
            config, r, coord.address, secret, lambda s: None, lambda r: None
        ).start()
        for r in range(2)
    ]
    try:
        assert coord.address.startswith("tcp://[::1]:")
        for part in parts:
            part.wait_for_group(5)
        parts[1].begin_forward(dummy=False)
        wait_until(lambda: parts[0].delivered >= 1, what="grant over IPv6")
    finally:
        coord.close(timeout_s=1)
        for part in parts:
            part.close(timeout_s=0.5)
