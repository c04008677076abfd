"""The step-sync cores driven directly: no socket, no thread, no sleep, time as a
number.

``test_random_schedules_keep_the_coordinator_rules`` runs a few hundred seeded
schedules of rank requests, passes, pauses, resumes, leaves, replays, forged ranges,
lost answers, silences and aborts through :class:`CoordinatorCore`, checking its rules
after every message and tick; ``test_random_groups_run_the_same_passes`` wires it to
:class:`ParticipantCore` s over a lossy in-memory network. The loopback tests
(test_step_sync*.py) stay as the integration tests.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import pytest

from vllm_disagg.v1.engine.step_sync import (
    PROTOCOL_VERSION,
    TO_COORDINATOR,
    TO_PARTICIPANT,
    Abort,
    CoordinatorCore,
    GroupPhase,
    GroupState,
    ParticipantCore,
    RankState,
    StepSyncConfig,
    seal,
)
from vllm_disagg.v1.engine.step_sync.credentials import group_key

SECRET = b"k" * 32
CONFIG = StepSyncConfig(dp_size=3, lookahead=2, peer_timeout_s=1.0)  # heartbeat 0.2 s


# --- a rank as the coordinator sees it ------------------------------------------------


class Rank:
    """The messages one rank sends; ``fields`` is its latest state."""

    def __init__(
        self, rank: int, config: StepSyncConfig = CONFIG, incarnation: str = ""
    ):
        self.route = f"route-{rank}".encode()
        self.fields = dict(
            version=PROTOCOL_VERSION,
            dp_rank=rank,
            dp_size=config.dp_size,
            lookahead=config.lookahead,
            incarnation=incarnation or f"rank{rank}",
            seq=0,
            requested=0,
            local_step=0,
            intent=0,
            want_pause=False,
            pause_ready=False,
            leaving=False,
            left=False,
        )
        self.sent: list[RankState] = []
        self.granted = 0  # the highest step that reached it
        self.group: GroupState | None = None
        self.silent = False

    def state(self, **changes) -> RankState:
        self.fields.update(changes)
        self.fields["seq"] += 1
        self.sent.append(RankState(**self.fields))
        return self.sent[-1]

    def forged(self, **changes) -> RankState:
        """A fresh message the coordinator must drop (its fields are not kept)."""
        self.fields["seq"] += 1
        return RankState(**{**self.fields, **changes})


def _group_states(out) -> list[tuple[bytes, GroupState]]:
    return [(route, msg) for route, msg in out if isinstance(msg, GroupState)]


@dataclass
class Checked:
    """Drives a CoordinatorCore and checks its rules after every call."""

    config: StepSyncConfig = CONFIG
    now: float = 0.0
    core: CoordinatorCore = field(init=False)
    accepted: dict[int, RankState] = field(default_factory=dict)  # latest per member
    last_seen: dict[int, float] = field(default_factory=dict)
    sent_step: dict[bytes, int] = field(
        default_factory=dict
    )  # highest step told per route
    grants: int = 0
    failures: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.core = CoordinatorCore(self.config, SECRET)
        self.core.start(self.now)

    def send(self, rank: Rank, msg: RankState, frames: bool = False) -> list:
        core, cfg = self.core, self.config
        step, phase, failed = core.step, core.phase, core.failed
        counts = core.counters.snapshot()
        known = self.accepted.get(msg.dp_rank)
        previous = (
            core.members[msg.dp_rank].state if msg.dp_rank in core.members else None
        )
        assert previous == known
        if frames:
            out = core.on_frames(
                [rank.route, *seal(SECRET, TO_COORDINATOR, msg)], self.now
            )
        else:
            out = core.on_message(rank.route, msg, self.now)
        if failed is not None:  # a failed group answers everyone with its reason
            assert out == [(rank.route, Abort(PROTOCOL_VERSION, out[0][1].seq, failed))]
            assert (core.step, core.phase, core.failed) == (step, phase, failed)
            return out
        member = core.members.get(msg.dp_rank)
        accepted = (
            member is not None and member.state is not previous and member.state == msg
        )
        bound = max(step, msg.local_step) + cfg.lookahead + 1
        if accepted:
            assert known is None or (
                known.incarnation == msg.incarnation and msg.seq > known.seq
            )
            assert msg.requested <= bound
            self.accepted[msg.dp_rank], self.last_seen[msg.dp_rank] = (
                member.state,
                self.now,
            )
        elif known is not None and known.incarnation == msg.incarnation:
            if msg.seq <= known.seq:
                assert (
                    core.counters.snapshot()["stale_messages"]
                    == counts["stale_messages"] + 1
                )
            else:
                assert msg.requested > bound
                assert core.counters.snapshot()["malformed_messages"] == (
                    counts["malformed_messages"] + 1
                )
            assert out == [] and core.step == step
        else:
            # a new process for a member, or a rank with other options: the group
            # fails
            assert core.failed is not None
        # G only grows, to an accepted request, within the look-ahead bound.
        assert core.step >= step
        if core.step > step:
            assert accepted and core.step == msg.requested <= bound
        self._check_phase(phase)
        self._check_out(out, failed_now=failed is None and core.failed is not None)
        return out

    def tick(self, dt: float) -> list:
        core, cfg = self.core, self.config
        self.now += dt
        due, failed = self.now >= core.next_heartbeat, core.failed
        out = core.on_tick(self.now)
        if not due or failed is not None:
            assert out == [] and core.failed == failed
            return out
        missing = [r for r in range(cfg.dp_size) if r not in core.members]
        silent = [
            r
            for r, s in self.accepted.items()
            if not s.left and self.now - self.last_seen[r] > cfg.peer_timeout_s
        ]
        late = missing and self.now > cfg.peer_timeout_s
        # A peer silent past its timeout (or a rank that never joined) fails the group;
        # nothing else does on a tick.
        assert (core.failed is not None) == bool(late or silent), (
            self.now,
            missing,
            silent,
        )
        if late:
            assert "did not join" in core.failed
        elif silent:
            assert f"DP rank {silent[0]} silent" in core.failed
        self._check_out(out, failed_now=core.failed is not None)
        return out

    def close(self, reason: str) -> list:
        failed, all_left = self.core.failed, self.core.all_left
        out = self.core.on_close(reason)
        if failed is not None or all_left:
            assert out == []
        else:
            assert sorted(r for r, _ in out) == sorted(
                m.route for m in self.core.members.values()
            )
            assert all(isinstance(m, Abort) and m.reason == reason for _, m in out)
        return out

    def _check_phase(self, before: GroupPhase) -> None:
        core, states = self.core, list(self.accepted.values())
        complete = len(core.members) == self.config.dp_size
        if core.failed is not None:
            return
        if core.phase != before:
            assert (
                before != GroupPhase.EXITING
                and complete
                and core.phase_step == core.step
            )
            if core.phase == GroupPhase.EXITING:
                assert all(s.leaving or s.left for s in states)
            elif core.phase == GroupPhase.PAUSED:
                assert before == GroupPhase.RUNNING and all(
                    s.pause_ready for s in states
                )
            else:
                assert before == GroupPhase.PAUSED and not any(
                    s.want_pause for s in states
                )
        if complete:  # and it moves as soon as every rank agrees
            if core.phase != GroupPhase.EXITING:
                assert not all(s.leaving or s.left for s in states)
            if core.phase == GroupPhase.RUNNING:
                assert not all(s.pause_ready for s in states)
            if core.phase == GroupPhase.PAUSED:
                assert any(s.want_pause for s in states)

    def _check_out(self, out: list, failed_now: bool) -> None:
        core = self.core
        routes = {m.route: rank for rank, m in core.members.items()}
        for route, msg in _group_states(out):
            state = self.accepted[routes[route]]
            assert (msg.ack_seq, msg.intent_ack) == (state.seq, state.intent)
            self.sent_step[route] = max(self.sent_step.get(route, 0), msg.step)
        self.grants += len(_group_states(out))
        assert core.counters.snapshot()["grants_sent"] == self.grants
        if failed_now:
            self.failures.append(core.failed)
            aborts = [route for route, msg in out if isinstance(msg, Abort)]
            assert set(routes) <= set(aborts)
            assert all(m.reason == core.failed for _, m in out if isinstance(m, Abort))
            last_abort = max(i for i, (_, m) in enumerate(out) if isinstance(m, Abort))
            assert not _group_states(out[last_abort:])
        elif core.failed is None:
            # No rank is granted a step the others were not: every member was told G.
            assert all(self.sent_step.get(route) == core.step for route in routes), (
                self.sent_step,
                core.step,
            )


# --- coordinator: random schedules ----------------------------------------------------


def _deliver(rng: random.Random, ranks: list[Rank], out: list, loss: float) -> None:
    by_route = {r.route: r for r in ranks}
    for route, msg in out:
        rank = by_route.get(route)
        if rank is None or rng.random() < loss or not isinstance(msg, GroupState):
            continue
        if rank.group is None or msg.seq > rank.group.seq:
            rank.group, rank.granted = msg, max(rank.granted, msg.step)


def _act(
    rng: random.Random, group: Checked, rank: Rank, ranks: list[Rank], loss: float
) -> None:
    """One thing a (well-behaved, mostly) rank does next."""
    f, cfg = rank.fields, group.config
    g = rank.group
    roll = rng.random()
    if roll < 0.25 and f["local_step"] < rank.granted:
        msg = rank.state(local_step=rng.randint(f["local_step"] + 1, rank.granted))
    elif roll < 0.45 and not (f["pause_ready"] or f["leaving"]):
        msg = rank.state(requested=max(f["requested"], f["local_step"] + cfg.lookahead))
    elif roll < 0.5:
        msg = rank.state(intent=f["intent"] + 1, want_pause=True, pause_ready=False)
    elif roll < 0.56 and f["want_pause"]:
        msg = rank.state(pause_ready=True)
    elif roll < 0.62:
        msg = rank.state(intent=f["intent"] + 1, want_pause=False, pause_ready=False)
    elif roll < 0.64:
        msg = rank.state(leaving=True)
    elif roll < 0.7 and g is not None and g.phase == GroupPhase.EXITING:
        msg = rank.state(local_step=max(f["local_step"], g.phase_step), left=True)
    elif roll < 0.75 and rank.sent:
        msg = copy.copy(
            rng.choice(rank.sent)
        )  # a replay, or a duplicate the network made
    elif roll < 0.8:
        over = (
            max(group.core.step, f["local_step"])
            + cfg.lookahead
            + 1
            + rng.randint(1, 10)
        )
        msg = rank.forged(requested=over)
    elif roll < 0.83:
        msg = rank.state(
            requested=f["requested"] + 1
        )  # within the bound: a greedy rank
    else:
        msg = rank.state()  # heartbeat
    _deliver(rng, ranks, group.send(rank, msg, frames=rng.random() < 0.1), loss)


FAULTS = [
    "none",
    "none",
    "silence",
    "late join",
    "restart",
    "leave alone",
    "options",
    "close",
]


def _schedule(seed: int) -> Checked:
    rng = random.Random(seed)
    fault = rng.choice(FAULTS)
    loss = rng.choice([0.0, 0.1, 0.5])
    group = Checked()
    ranks = [Rank(r) for r in range(CONFIG.dp_size)]
    joining = ranks[:-1] if fault in ("late join", "options") else ranks
    for rank in rng.sample(joining, len(joining)):
        _deliver(rng, ranks, group.send(rank, rank.state()), loss)
    fault_at = rng.randrange(0, 20) if fault == "options" else rng.randrange(20, 200)
    for event in range(300):
        if event == fault_at:
            victim = rng.choice(ranks)
            if fault == "silence":
                victim.silent = True
            elif fault == "restart":  # the same rank, from a new process
                restarted = Rank(victim.fields["dp_rank"], incarnation="new")
                group.send(victim, restarted.state())
            elif fault == "leave alone" and group.core.phase != GroupPhase.EXITING:
                group.send(victim, victim.state(left=True))
            elif fault == "options":  # the missing rank comes, with other options
                stranger = Rank(
                    ranks[-1].fields["dp_rank"], StepSyncConfig(3, lookahead=5)
                )
                group.send(stranger, stranger.state())
            elif fault == "close":
                group.close("the coordinator (DP rank 0) shut down")
                return group
        if rng.random() < 0.3:
            _deliver(rng, ranks, group.tick(rng.uniform(0.0, 0.1)), loss)
        # Each live rank heartbeats as its shell would: at least every heartbeat
        # interval.
        for rank in joining:
            due = group.now - group.last_seen.get(rank.fields["dp_rank"], group.now)
            if not rank.silent and due >= CONFIG.heartbeat_interval_s / 2:
                _deliver(rng, ranks, group.send(rank, rank.state()), loss)
        speakers = [r for r in ranks if not r.silent and r in joining]
        _act(rng, group, rng.choice(speakers), ranks, loss)
        if group.core.failed is not None and rng.random() < 0.05:
            break
    for _ in range(
        int(2 * CONFIG.peer_timeout_s / 0.1) + 2
    ):  # let every timeout run out
        group.tick(0.1)
        for rank in ranks:
            if not rank.silent and rank in joining and group.core.failed is None:
                group.send(rank, rank.state())
    return group


def test_random_schedules_keep_the_coordinator_rules():
    outcomes: dict[str, int] = {}
    phases: set[GroupPhase] = set()
    for seed in range(300):
        group = _schedule(seed)
        reason = (group.core.failed or "ok")[:40]
        outcomes[reason] = outcomes.get(reason, 0) + 1
        phases.add(group.core.phase)
    # The schedules reach every phase and every kind of failure.
    assert phases == set(GroupPhase), phases
    text = " | ".join(outcomes)
    for kind in (
        "silent",
        "did not join",
        "re-registered",
        "left the group",
        "was rejected",
    ):
        assert kind in text, text


# --- coordinator: the rules one at a time ---------------------------------------------


def _joined(config: StepSyncConfig = CONFIG) -> tuple[Checked, list[Rank]]:
    group = Checked(config)
    ranks = [Rank(r, config) for r in range(config.dp_size)]
    for rank in ranks:
        group.send(rank, rank.state())
    return group, ranks


def test_a_grant_goes_to_every_member_in_one_broadcast():
    group, ranks = _joined()
    out = group.send(ranks[1], ranks[1].state(requested=2))
    assert [(route, msg.step) for route, msg in out] == [(r.route, 2) for r in ranks]
    # A repeated or lower request is answered to its sender only, with the same G.
    out = group.send(ranks[2], ranks[2].state(requested=1))
    assert [(route, msg.step) for route, msg in out] == [(ranks[2].route, 2)]


def test_requests_that_arrive_together_get_one_state_each():
    """Every rank asks for the next steps at once: one at a time, the first request
    moves G (a broadcast) and each other one gets its own reply; in one batch each
    member gets a single state, with G and its own acknowledgement."""
    sent = {}
    for batched in (False, True):
        group, ranks = _joined()
        core = group.core
        frames = [
            [r.route, *seal(SECRET, TO_COORDINATOR, r.state(requested=2))]
            for r in ranks
        ]
        if batched:
            out = core.on_frame_batch(frames, 1.0)
        else:
            out = [m for f in frames for m in core.on_frames(f, 1.0)]
        assert core.step == 2
        last = {route: msg for route, msg in out}
        assert {r.route for r in ranks} == set(last)
        for r in ranks:
            assert last[r.route].step == 2
            assert last[r.route].ack_seq == r.fields["seq"]
        sent[batched] = len(out)
    n = CONFIG.dp_size
    assert sent == {False: n + (n - 1), True: n}


def test_a_batch_that_fails_the_group_tells_every_member():
    group, ranks = _joined()
    frames = [
        [ranks[0].route, *seal(SECRET, TO_COORDINATOR, ranks[0].state(requested=2))],
        [ranks[1].route, *seal(SECRET, TO_COORDINATOR, ranks[1].state(left=True))],
    ]
    out = group.core.on_frame_batch(frames, 1.0)
    aborts = {route for route, msg in out if isinstance(msg, Abort)}
    assert aborts == {r.route for r in ranks}
    assert "DP rank 1 left the group" in group.core.failed


def test_the_lookahead_bounds_a_request_by_the_askers_own_pass_count():
    group, ranks = _joined()
    bound = CONFIG.lookahead + 1
    assert group.send(ranks[0], ranks[0].forged(requested=bound + 1)) == []
    assert group.core.step == 0
    group.send(ranks[0], ranks[0].state(requested=bound))
    assert group.core.step == bound
    # A rank that ran ahead of G (its own pass count) may ask past it by the same
    # margin.
    group.send(ranks[1], ranks[1].state(local_step=10, requested=10 + bound))
    assert group.core.step == 10 + bound


def test_pause_resume_and_exit_happen_when_every_rank_agrees():
    group, ranks = _joined()
    group.send(ranks[0], ranks[0].state(requested=2))
    for rank in ranks:
        group.send(rank, rank.state(intent=1, want_pause=True, pause_ready=True))
    assert (group.core.phase, group.core.phase_step) == (GroupPhase.PAUSED, 2)
    group.send(ranks[0], ranks[0].state(intent=2, want_pause=False, pause_ready=False))
    assert group.core.phase == GroupPhase.PAUSED  # the others still want the pause
    for rank in ranks[1:]:
        group.send(rank, rank.state(intent=2, want_pause=False, pause_ready=False))
    assert group.core.phase == GroupPhase.RUNNING
    group.send(ranks[2], ranks[2].state(requested=4))
    for rank in ranks:
        group.send(rank, rank.state(leaving=True))
    assert (group.core.phase, group.core.phase_step) == (GroupPhase.EXITING, 4)
    for rank in ranks:
        group.send(rank, rank.state(local_step=4, left=True))
    assert group.core.all_left and group.core.failed is None
    assert group.close("bye") == []  # nobody is left to tell


def test_a_request_after_promising_no_more_work_is_granted_and_counted():
    group, ranks = _joined()
    group.send(ranks[0], ranks[0].state(intent=1, want_pause=True, pause_ready=True))
    group.send(ranks[0], ranks[0].state(requested=2))
    assert group.core.step == 2
    assert group.core.counters.snapshot()["pause_violations"] == 1


def test_a_silent_member_fails_the_group_after_its_timeout_and_not_before():
    group, ranks = _joined()
    for _ in range(15):  # to 0.9375 s
        group.tick(0.0625)
        for rank in ranks[:2]:
            group.send(rank, rank.state())
        assert group.core.failed is None
    group.tick(0.3)
    assert group.core.failed.startswith("DP rank 2 silent for 1.2s")


def test_a_member_that_left_may_be_silent():
    group, ranks = _joined()
    for rank in ranks:
        group.send(rank, rank.state(leaving=True))
    group.send(ranks[0], ranks[0].state(left=True))
    for _ in range(30):
        group.tick(0.1)
        for rank in ranks[1:]:
            group.send(rank, rank.state())
    assert group.core.failed is None


def test_a_missing_rank_fails_the_group_at_the_join_deadline():
    group = Checked()
    ranks = [Rank(0), Rank(2)]
    for rank in ranks:
        group.send(rank, rank.state())
    for _ in range(12):
        group.tick(0.1)
        for rank in ranks:
            group.send(rank, rank.state())
    assert (
        "DP rank(s) 1 did not join the step-sync group within 1s" in group.core.failed
    )
    # Whoever speaks later hears why.
    late = Rank(1)
    out = group.send(late, late.state())
    assert out[0][1].reason == group.core.failed


def test_a_rank_with_other_options_is_told_why_and_the_group_fails():
    group = Checked()
    group.send(Rank(0), Rank(0).state())
    stranger = Rank(1, StepSyncConfig(dp_size=4, lookahead=2))
    out = group.send(stranger, stranger.state())
    assert out[0] == (stranger.route, out[0][1]) and isinstance(out[0][1], Abort)
    assert (
        "data_parallel_size=4" in out[0][1].reason
        and group.core.failed == out[0][1].reason
    )
    assert group.core.registered == (0,)


@pytest.mark.parametrize(
    "frames, counter",
    [
        ([b"route"], "malformed_messages"),
        ([b"route", b"payload", b"not a mac"], "unauthenticated_messages"),
        (
            [b"route", *seal(b"x" * 32, TO_COORDINATOR, Rank(0).state())],
            "unauthenticated_messages",
        ),
        (
            [b"route", *seal(SECRET, TO_PARTICIPANT, Rank(0).state())],
            "unauthenticated_messages",
        ),
        (
            [b"route", *seal(SECRET, TO_COORDINATOR, Abort(PROTOCOL_VERSION, 1, "no"))],
            "malformed_messages",
        ),
        (
            [b"route", *seal(SECRET, TO_COORDINATOR, Abort(1, 1, "old"))],
            "malformed_messages",
        ),
        (
            [b"route", *seal(SECRET, TO_COORDINATOR, Rank(7).state())],
            "malformed_messages",
        ),
    ],
)
def test_frames_the_coordinator_drops_are_counted_and_change_nothing(frames, counter):
    group, _ = _joined()
    before = group.core.counters.snapshot()
    assert group.core.on_frames(frames, 0.0) == []
    after = group.core.counters.snapshot()
    assert after[counter] == before[counter] + 1
    assert (group.core.step, group.core.failed, group.core.registered) == (
        0,
        None,
        (0, 1, 2),
    )


# --- participant core -----------------------------------------------------------------


def _participant(rank: int = 1, config: StepSyncConfig = CONFIG) -> ParticipantCore:
    return ParticipantCore(config, rank, f"inc{rank}", SECRET)


def _group_frames(
    seq: int, step: int, ack_seq: int = 0, phase=GroupPhase.RUNNING, phase_step: int = 0
) -> list[bytes]:
    state = GroupState(PROTOCOL_VERSION, seq, step, phase, phase_step, 3, ack_seq, 0)
    return seal(SECRET, TO_PARTICIPANT, state)


def test_a_participant_renews_its_lease_before_it_runs_out():
    part = _participant()
    assert part.request_ahead() == 1 and part.requested == CONFIG.lookahead
    assert part.request_ahead() is None  # already asked
    part.observe_grant(2)
    assert part.begin_forward(dummy=False) == 1
    assert (
        part.requested == 2
    )  # one granted step left: margin (lookahead + 1) // 2 not reached
    part.begin_forward(dummy=False)
    assert part.requested == 4 and part.counters.snapshot()["requests_sent"] == 2
    assert part.begin_forward(dummy=True) == 3 and part.dummy_steps == 1


def _drain(part: ParticipantCore, passes: int, known: bool) -> None:
    """One request of ``passes`` passes on an idle rank, every grant arriving at once;
    ``known``: the engine tells how many passes the work can still use."""
    part.request_ahead(passes if known else None)
    for left in range(passes - 1, -1, -1):
        part.observe_grant(part.requested)
        part.begin_forward(dummy=False, passes_after=left if known else None)
    part.observe_grant(part.requested)


@pytest.mark.parametrize("lookahead", [1, 2, 3, 8])
@pytest.mark.parametrize("passes", [1, 2, 3, 7, 8, 20])
def test_the_adaptive_lookahead_asks_for_no_pass_the_work_cannot_use(lookahead, passes):
    config = StepSyncConfig(dp_size=3, lookahead=lookahead, peer_timeout_s=1.0)
    fixed, adaptive = _participant(config=config), _participant(config=config)
    _drain(fixed, passes, known=False)
    _drain(adaptive, passes, known=True)
    # Unknown work: up to `lookahead` passes past the last real one (the old rule).
    assert passes < fixed.requested <= passes + lookahead
    # Known work: the grant ends at the last real pass: no pass wasted.
    assert adaptive.requested == adaptive.local_step == passes
    # And no more requests than the fixed look-ahead needs, nor a real pass asked
    # for late (every pass was requested before the rank reached it).
    sent = adaptive.counters.snapshot()["requests_sent"]
    assert sent <= fixed.counters.snapshot()["requests_sent"]


def test_the_adaptive_lookahead_never_asks_below_the_next_pass_for_new_work():
    part = _participant()
    assert part.request_ahead(0) == 1 and part.requested == 1  # work: at least a pass
    part.observe_grant(1)
    part.begin_forward(dummy=False, passes_after=0)
    assert part.requested == 1 and part.counters.snapshot()["requests_sent"] == 1
    # The bound was wrong (the work needs another pass): the pass asks for itself.
    part.begin_forward(dummy=False, passes_after=None)
    assert part.requested == 2 + CONFIG.lookahead


def test_a_participant_takes_each_grant_once_and_drops_stale_ones():
    part = _participant()
    part.start(0.0)
    received = part.on_frames(_group_frames(1, 2), 0.1)
    assert received.grant == 2 and received.group.step == 2 and part.delivered == 2
    assert part.on_frames(_group_frames(1, 5), 0.2) is None  # replayed seq
    received = part.on_frames(_group_frames(2, 2), 0.3)
    assert received == (None, None)  # nothing new for the engine
    received = part.on_frames(
        _group_frames(3, 2, phase=GroupPhase.PAUSED, phase_step=2), 0.4
    )
    assert received.grant is None and received.group.phase == GroupPhase.PAUSED
    assert part.on_frames(seal(b"x" * 32, TO_PARTICIPANT, received.group), 0.5) is None
    assert part.counters.snapshot()["malformed_messages"] == 2


def test_a_participant_resends_until_acknowledged_then_only_heartbeats():
    part = _participant()
    first = part.start(0.0)
    assert first.seq == 1
    assert part.on_tick(0.05) is None  # within the resend interval
    again = part.on_tick(0.1)
    assert again.seq == 2 and part.counters.snapshot()["resends"] == 1
    part.on_frames(_group_frames(1, 0, ack_seq=2), 0.11)
    assert part.acknowledged(part.state)
    assert part.on_tick(0.25) is None  # acknowledged: quiet until the heartbeat
    assert part.on_tick(0.1 + CONFIG.heartbeat_interval_s).seq == 3
    part.set_pause_intent(True)
    assert part.on_tick(0.31).want_pause  # a change goes out at once


def test_a_participant_fails_when_the_coordinator_is_silent_or_aborts():
    part = _participant()
    part.start(0.0)
    part.on_tick(1.0)
    assert part.failed is None
    part.on_tick(1.01)
    assert part.failed.startswith("step sync coordinator silent for 1.0s")
    aborted = _participant()
    aborted.start(0.0)
    assert aborted.on_frames(
        seal(SECRET, TO_PARTICIPANT, Abort(PROTOCOL_VERSION, 1, "why")), 0.1
    ) == (
        None,
        None,
    )
    assert aborted.failed == "step sync coordinator aborted the DP group: why"


@pytest.mark.parametrize("ahead", [False, True])
def test_the_progress_watch_reports_a_rank_that_cannot_progress(ahead):
    part = _participant()
    part.start(0.0)
    part.watch_progress = True
    if ahead:
        part.begin_forward(dummy=False)  # ran pass 1, which never gets granted
    else:
        part.on_frames(_group_frames(1, 3), 0.0)  # owes passes 1..3, runs none
    now, seq = 0.0, 1
    while part.failed is None and now < 5:
        now, seq = now + 0.1, seq + 1
        part.on_frames(
            _group_frames(seq, 0 if ahead else 3), now
        )  # the coordinator is alive
        part.on_tick(now)
    assert part.failed == part.stalled
    expected = (
        "ran pass 1 but the group granted only up to 0" if ahead else "owes passes 1..3"
    )
    assert expected in part.failed and 1.0 < now < 1.5


# --- both cores over a lossy network --------------------------------------------------


@dataclass
class SimRank:
    core: ParticipantCore
    work: int
    in_pass: int = 0  # the pass it is in, waiting for its grant (a collective)
    last_real: int = 0  # the step of its last real pass


def _run_group(seed: int) -> tuple[CoordinatorCore, list[SimRank], bool]:
    rng = random.Random(seed)
    cfg = StepSyncConfig(
        dp_size=rng.randint(2, 4), lookahead=rng.choice([1, 2, 8]), peer_timeout_s=1.0
    )
    loss = rng.choice([0.0, 0.05, 0.2])
    known_work = rng.random() < 0.5
    batched = rng.random() < 0.5
    coord = CoordinatorCore(cfg, SECRET)
    coord.start(0.0)
    ranks = [
        SimRank(ParticipantCore(cfg, r, f"i{r}", SECRET), rng.randint(0, 40))
        for r in range(cfg.dp_size)
    ]
    wire: list[
        tuple[float, int | None, list[bytes]]
    ] = []  # (arrives at, to rank, frames)

    def to_coord(now: float, rank: int, msg: RankState | None) -> None:
        if msg is not None and rng.random() >= loss:
            wire.append(
                (
                    now + rng.uniform(0, 0.01),
                    None,
                    [bytes([rank])] + seal(SECRET, TO_COORDINATOR, msg),
                )
            )

    def to_ranks(now: float, out: list) -> None:
        for route, msg in out:
            if rng.random() >= loss:
                wire.append(
                    (
                        now + rng.uniform(0, 0.01),
                        route[0],
                        seal(SECRET, TO_PARTICIPANT, msg),
                    )
                )

    now = 0.0
    for r, sim in enumerate(ranks):
        to_coord(now, r, sim.core.start(now))
        sim.core.watch_progress = True
    while now < 60:
        now += rng.uniform(0, 0.005)
        rng.shuffle(wire)  # reordering, as well as loss
        due = [w for w in wire if w[0] <= now]
        if batched:  # what reached the coordinator together is answered together
            batch = [w for w in due if w[1] is None]
            due = [w for w in due if w[1] is not None]
            for item in batch:
                wire.remove(item)
            to_ranks(now, coord.on_frame_batch([w[2] for w in batch], now))
        for item in due:
            wire.remove(item)
            _, to, frames = item
            if to is None:
                to_ranks(now, coord.on_frames(frames, now))
            else:
                received = ranks[to].core.on_frames(frames, now)
                if received is not None and received.grant is not None:
                    ranks[to].core.observe_grant(received.grant)
        to_ranks(now, coord.on_tick(now))
        for r, sim in enumerate(ranks):
            part = sim.core
            if sim.in_pass:
                # A pass ends once the group was granted its step (its peers reach it).
                assert sim.in_pass <= max(coord.step, part.requested)
                if part.delivered >= sim.in_pass:
                    sim.in_pass = 0
            elif sim.work:
                if rng.random() < 0.5:  # scheduling takes a while
                    # With known_work the engine tells how many passes its work
                    # can still use (the adaptive look-ahead), else nothing.
                    part.request_ahead(sim.work if known_work else None)
                    sim.in_pass = sim.last_real = part.begin_forward(
                        dummy=False, passes_after=sim.work - 1 if known_work else None
                    )
                    sim.work -= 1
            elif part.steps_owed:
                sim.in_pass = part.begin_forward(dummy=True)
            to_coord(now, r, part.on_tick(now))
            assert part.failed is None, (seed, part.failed)
        assert coord.failed is None, (seed, coord.failed)
        quiet = all(
            not s.work and not s.in_pass and not s.core.steps_owed for s in ranks
        )
        if quiet and all(
            s.core.local_step == s.core.delivered == coord.step for s in ranks
        ):
            return coord, ranks, known_work
    raise AssertionError(f"seed {seed}: no settled state by t={now:.1f}s")


def test_random_groups_run_the_same_passes():
    for seed in range(200):
        coord, ranks, known_work = _run_group(seed)
        last_real = max(s.last_real for s in ranks)
        for sim in ranks:
            part = sim.core
            assert (
                part.local_step == part.forward_steps + part.dummy_steps == coord.step
            )
        # Passes wasted after the last real pass are bounded by the lease, and
        # none are when every rank knows how many passes its work can use.
        assert last_real <= coord.step <= last_real + coord.config.lookahead
        if known_work:
            assert coord.step == last_real, seed


# --- strangers: only frames under the group's key count -------------------------------

OPERATOR_SECRET = b"the operator's VLLM_DISAGG_DP_SECRET, the same on every rank"
GROUP_ID = "a" * 32
GROUP_KEY = group_key(OPERATOR_SECRET, GROUP_ID)
# Keys a stranger can try: nothing it reads in the DP store (the coordinator's
# address, the group id) or a recording of another group gives it this group's key.
STRANGER_KEYS = {
    "none (no MAC)": b"",
    "random": bytes(range(32)),
    "the group id": GROUP_ID.encode(),
    "the coordinator address": b"tcp://127.0.0.1:5555",
    "an earlier group of the same secret (a recording)": group_key(
        OPERATOR_SECRET, "b" * 32
    ),
    "this group's id under another secret": group_key(b"another secret", GROUP_ID),
    "the secret itself, underived": OPERATOR_SECRET,
}


def _keyed_group(joining=(0, 1, 2)) -> tuple[CoordinatorCore, list[Rank]]:
    core = CoordinatorCore(CONFIG, GROUP_KEY)
    core.start(0.0)
    ranks = [Rank(r) for r in range(CONFIG.dp_size)]
    for r in joining:
        msg = ranks[r].state()
        core.on_frames([ranks[r].route, *seal(GROUP_KEY, TO_COORDINATOR, msg)], 0.0)
    return core, ranks


def _attempts(ranks: list[Rank]) -> list[RankState]:
    """What would fail the group, or move it, if it were authenticated."""
    other_options = Rank(2, StepSyncConfig(dp_size=3, lookahead=5))
    return [
        Rank(1, incarnation="a new process").state(),  # a new incarnation of rank 1
        ranks[1].forged(left=True),  # rank 1 leaving outside an agreed exit
        other_options.state(),  # rank 2 with other options
        ranks[0].forged(requested=3),  # a step request for a real rank
        ranks[2].forged(leaving=True, pause_ready=True, want_pause=True),
    ]


@pytest.mark.parametrize("what", sorted(STRANGER_KEYS))
def test_a_stranger_cannot_fail_or_move_a_formed_group(what):
    core, ranks = _keyed_group()
    routes = {r: m.route for r, m in core.members.items()}
    states = {r: m.state for r, m in core.members.items()}
    attempts = _attempts(ranks)
    for msg in attempts:
        frames = [b"stranger", *seal(STRANGER_KEYS[what], TO_COORDINATOR, msg)]
        assert core.on_frames(frames, 0.1) == []
    assert core.failed is None and core.step == 0
    assert core.counters.snapshot()["unauthenticated_messages"] == len(attempts)
    assert {r: m.route for r, m in core.members.items()} == routes
    assert {r: m.state for r, m in core.members.items()} == states
    # The members go on as if nothing happened.
    msg = ranks[1].state(requested=2)
    out = core.on_frames([ranks[1].route, *seal(GROUP_KEY, TO_COORDINATOR, msg)], 0.2)
    assert core.step == 2
    assert sorted(route for route, _ in out) == sorted(routes.values())


@pytest.mark.parametrize("what", sorted(STRANGER_KEYS))
def test_a_stranger_cannot_join_or_fail_a_forming_group(what):
    core, ranks = _keyed_group(joining=(0, 1))
    for msg in _attempts(ranks):
        frames = [b"stranger", *seal(STRANGER_KEYS[what], TO_COORDINATOR, msg)]
        assert core.on_frames(frames, 0.1) == []
    assert core.failed is None and core.registered == (0, 1)
    msg = ranks[2].state()
    core.on_frames([ranks[2].route, *seal(GROUP_KEY, TO_COORDINATOR, msg)], 0.2)
    assert core.registered == (0, 1, 2) and core.failed is None


def test_an_authenticated_new_incarnation_fails_the_group_and_hears_why():
    """The one thing a new process for a rank may do, and only with the group's key
    (the launcher's or operator's secret and this group's id): end the group at
    once, since its peers cannot go on without the process it replaces."""
    core, ranks = _keyed_group()
    newcomer = Rank(1, incarnation="restarted")
    newcomer.route = b"another connection"
    out = core.on_frames(
        [newcomer.route, *seal(GROUP_KEY, TO_COORDINATOR, newcomer.state())], 0.1
    )
    reason = "DP rank 1 re-registered as a new process (restarted)"
    assert core.failed == reason
    told = {route for route, msg in out if isinstance(msg, Abort)}
    assert told == {r.route for r in ranks} | {newcomer.route}
    assert all(msg.reason == reason for _, msg in out)


def test_a_missing_rank_whose_frames_fail_authentication_is_named_so():
    """A rank started with another secret is dropped like a stranger; the reason
    the group did not form says so."""
    core, ranks = _keyed_group(joining=(0, 1))
    other = group_key(b"another secret", GROUP_ID)
    for now in (0.1, 0.2):
        core.on_frames([b"r2", *seal(other, TO_COORDINATOR, ranks[2].state())], now)
    core.on_tick(CONFIG.peer_timeout_s + 0.5)
    assert "DP rank(s) 2 did not join" in core.failed
    assert core.failed.endswith(
        ", and the same step-sync secret (2 frames failed authentication)"
    )


def test_a_participant_ignores_frames_under_another_groups_key():
    part = ParticipantCore(CONFIG, 1, "inc1", GROUP_KEY)
    part.start(0.0)
    earlier = group_key(OPERATOR_SECRET, "b" * 32)
    assert (
        part.on_frames(
            seal(earlier, TO_PARTICIPANT, Abort(PROTOCOL_VERSION, 1, "x")), 0.1
        )
        is None
    )
    state = GroupState(PROTOCOL_VERSION, 1, 5, GroupPhase.RUNNING, 0, 3, 0, 0)
    assert part.on_frames(seal(earlier, TO_PARTICIPANT, state), 0.2) is None
    assert part.failed is None and part.delivered == 0
    assert part.on_frames(seal(GROUP_KEY, TO_PARTICIPANT, state), 0.3).grant == 5
