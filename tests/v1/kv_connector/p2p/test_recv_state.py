"""The receive-side key state machine, driven directly: no sockets, no
threads, time passed in."""

from __future__ import annotations

import random

import pytest

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.recv_state import (
    TRANSITIONS,
    Event,
    RecvState,
    RecvTable,
    Timeouts,
    TransitionError,
)

T = Timeouts(hold_s=60.0, grace_s=5.0, closed_s=300.0)


def test_the_happy_paths():
    table = RecvTable(T)
    # decode first (PUT after the request, GET)
    steps = [
        (Event.EXPECT, RecvState.EXPECTED),
        (Event.OFFER, RecvState.RECEIVING),
        (Event.RECEIVED, RecvState.READY),
        (Event.TAKEN, RecvState.CLOSED),
    ]
    for t, (event, state) in enumerate(steps):
        given = 30.0 if event in (Event.EXPECT, Event.OFFER) else None
        table.apply("a", event, float(t), deadline=given)
        assert table.state("a") is state
    # KV first (PUT_ASYNC before decode knows the request)
    table.apply("b", Event.OFFER, 0.0, deadline=60.0)
    table.apply("b", Event.RECEIVED, 1.0)
    table.apply("b", Event.EXPECT, 2.0, deadline=32.0)
    assert table.state("b") is RecvState.READY


def test_a_closed_key_refuses_offers_until_forgotten():
    table = RecvTable(T)
    table.apply("k", Event.ABANDON, 0.0)
    assert not table.allows("k", Event.OFFER)
    with pytest.raises(TransitionError):
        table.apply("k", Event.OFFER, 1.0)
    table.expire(T.closed_s + 1.0)
    assert table.state("k") is None and table.allows("k", Event.OFFER)


def test_abandoned_while_receiving_is_closed_when_the_bytes_end():
    table = RecvTable(T)
    table.apply("k", Event.EXPECT, 0.0, deadline=30.0)
    table.apply("k", Event.OFFER, 1.0, deadline=30.0)
    table.apply("k", Event.ABANDON, 2.0)
    assert table.state("k") is RecvState.ABANDONING
    assert (
        table.expire(1000.0) == []
    )  # the receive's own deadline ends it, not the sweep
    table.apply("k", Event.FAILED, 1001.0)
    assert table.state("k") is RecvState.CLOSED


@pytest.mark.parametrize("state", list(RecvState))
def test_every_state_has_a_way_out_by_time_alone(state):
    """Expiry (plus, for ABANDONING, the end of its receive) brings every key
    to nothing: no key waits forever."""
    table = RecvTable(T)
    path = {
        RecvState.EXPECTED: [Event.EXPECT],
        RecvState.RECEIVING: [Event.OFFER],
        RecvState.ABANDONING: [Event.OFFER, Event.ABANDON],
        RecvState.READY: [Event.FAILED],
        RecvState.CLOSED: [Event.ABANDON],
    }[state]
    for event in path:
        table.apply("k", event, 0.0, deadline=30.0 if event is Event.EXPECT else None)
    assert table.state("k") is state
    now = 0.0
    for _ in range(4):
        now += 1000.0
        table.expire(now)
        if table.state("k") is RecvState.ABANDONING:
            table.apply(
                "k", Event.FAILED, now
            )  # what the receive thread does at its deadline
    assert table.state("k") is None


def test_random_interleavings_keep_the_invariants():
    """Thousands of random event orders: only listed transitions happen, every
    state's deadline lies ahead of the event that set it, and sweeping far in
    the future empties the table once receives end."""
    rng = random.Random(20261125)
    events = list(Event)
    for _ in range(3000):
        table = RecvTable(T)
        now = 0.0
        for _ in range(rng.randrange(1, 12)):
            now += rng.choice([0.0, 0.5, 10.0, 100.0])
            event = rng.choice(events)
            before = table.state("k")
            if event is Event.EXPIRE:
                table.expire(now)
                continue
            if not table.allows("k", event):
                with pytest.raises(TransitionError):
                    table.apply("k", event, now)
                assert table.state("k") is before
                continue
            entry = table.apply("k", event, now, deadline=now + 30.0)
            assert (before, event) in TRANSITIONS
            assert entry.state is TRANSITIONS[(before, event)]
            assert entry.deadline > now
        for _ in range(3):
            now += 10_000.0
            table.expire(now)
            if table.state("k") is RecvState.ABANDONING:
                table.apply("k", Event.RECEIVED, now)
        assert table.state("k") is None


def test_the_oldest_unclaimed_ready_key_holding_bytes_goes_first():
    class Slot:
        def __init__(self, nbytes):
            self.nbytes = nbytes

    table = RecvTable(T)
    for t, key in enumerate(["old", "claimed", "empty", "new"]):
        table.apply(key, Event.OFFER, float(t), deadline=100.0)
        table.apply(key, Event.RECEIVED, float(t))
        table.get(key).slot = Slot(0 if key == "empty" else 64)
    table.apply("claimed", Event.EXPECT, 10.0, deadline=40.0)
    table.apply("receiving", Event.OFFER, 0.0, deadline=100.0)
    table.get("receiving").slot = Slot(64)
    assert table.oldest_unclaimed().key == "old"
    table.get("old").slot = Slot(0)  # freed: holds nothing any more
    assert table.oldest_unclaimed().key == "new"
    table.apply("new", Event.TAKEN, 11.0)
    assert table.oldest_unclaimed() is None
