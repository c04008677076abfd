"""The send-side state table and the pure decisions of the transfer core
(send_state.py, recv_state.decide_offer), driven directly: no sockets, no
threads, time passed in."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import Refusal
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.recv_state import (
    Event,
    OfferAnswer,
    OfferFacts,
    RecvTable,
    Timeouts,
    decide_offer,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.send_state import (
    TRANSITIONS,
    GetAnswer,
    SendEvent,
    SendState,
    SendTable,
    decide_get,
    step,
)

TOMBSTONE_S = 300.0


@dataclass(eq=False)
class Xfer:
    key: str
    deadline: float = 10.0
    decode_host: str = ""
    state: SendState | None = None


# --- the table -----------------------------------------------------------------


def test_states_only_move_forward():
    for (state, _), target in TRANSITIONS.items():
        assert state is None or target > state
    assert [s.released for s in SendState] == [False, False, True, True, True]


def test_every_released_state_is_final():
    for state, event in itertools.product(SendState, SendEvent):
        if state.released:
            assert step(state, event) is None


def test_a_put_send_ends_once():
    table = SendTable(TOMBSTONE_S)
    xfer = Xfer("k")
    assert table.apply(xfer, SendEvent.QUEUE, 0.0) and xfer.state is SendState.SENDING
    assert table.apply(xfer, SendEvent.SENT, 1.0) and xfer.state is SendState.SENT
    # The sweep's backstop racing the send: ignored, nothing changes.
    assert not table.apply(xfer, SendEvent.FAIL, 1.0)
    assert not table.apply(xfer, SendEvent.EXPIRE, 1.0)
    assert xfer.state is SendState.SENT
    assert table.keys == {}  # PUT sends are not filed by key


def test_a_hold_is_pulled_sent_and_remembered_as_gone():
    table = SendTable(TOMBSTONE_S)
    xfer = Xfer("k", deadline=10.0)
    assert table.hold(xfer, 0.0) is None
    assert table.keys["k"].until == 10.0
    assert table.apply(xfer, SendEvent.PULL, 1.0)
    assert table.apply(xfer, SendEvent.SENT, 2.0)
    assert table.keys["k"].until == 2.0 + TOMBSTONE_S
    assert decide_get(table.get("k"), "h") is GetAnswer.GONE
    assert table.expire(2.0 + TOMBSTONE_S + 1) == []
    assert table.get("k") is None


def test_a_hold_nobody_pulls_expires_once():
    table = SendTable(TOMBSTONE_S)
    xfer = Xfer("k", deadline=10.0)
    table.hold(xfer, 0.0)
    assert table.expire(10.0) == []  # not past it yet
    assert table.expire(10.5) == [xfer] and xfer.state is SendState.EXPIRED
    assert table.expire(11.0) == []  # remembered, not expired again
    assert not table.apply(xfer, SendEvent.FAIL, 11.0)


def test_a_pulled_send_past_its_deadline_expires():
    table = SendTable(TOMBSTONE_S)
    xfer = Xfer("k", deadline=10.0)
    table.hold(xfer, 0.0)
    table.apply(xfer, SendEvent.PULL, 1.0)
    assert table.expire(11.0) == [xfer] and xfer.state is SendState.EXPIRED
    assert not table.apply(xfer, SendEvent.SENT, 12.0)  # its send ends late: ignored


def test_a_second_hold_replaces_a_held_one_not_one_being_sent():
    table = SendTable(TOMBSTONE_S)
    first, second, third = Xfer("k"), Xfer("k"), Xfer("k")
    table.hold(first, 0.0)
    assert table.hold(second, 1.0) is first  # the caller fails it
    assert table.apply(first, SendEvent.FAIL, 1.0)
    assert table.get("k") is second  # first's end does not touch second's entry
    table.apply(second, SendEvent.PULL, 2.0)
    assert table.hold(third, 3.0) is None  # second ends on its own
    assert table.apply(second, SendEvent.SENT, 4.0)
    assert table.get("k") is third and table.keys["k"].until == third.deadline


# --- a Get ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "state, held_for, host, answer",
    [
        (None, "", "h", GetAnswer.NOT_READY),
        (SendState.HELD, "", "h", GetAnswer.PULL),
        (SendState.HELD, "h", "h", GetAnswer.PULL),
        (SendState.HELD, "other", "h", GetAnswer.NOT_YOURS),
        (SendState.SENDING, "h", "h", GetAnswer.SENDING),
        (SendState.SENDING, "other", "h", GetAnswer.NOT_YOURS),
        (SendState.SENT, "", "h", GetAnswer.GONE),
        (SendState.FAILED, "h", "h", GetAnswer.GONE),
        (SendState.EXPIRED, "", "h", GetAnswer.GONE),
        (SendState.EXPIRED, "other", "h", GetAnswer.NOT_YOURS),
    ],
)
def test_what_a_get_gets(state, held_for, host, answer):
    held = None if state is None else Xfer("k", decode_host=held_for, state=state)
    assert decide_get(held, host) is answer


# --- an offer ------------------------------------------------------------------

DIGEST, OTHER = b"d" * 16, b"o" * 16


def _facts(**kw) -> OfferFacts:
    base = dict(
        key="k",
        num_blocks=4,
        prompt_digest=DIGEST,
        channel="c",
        channel_ok=True,
        offered_by="10.0.0.1",
        max_blocks=64,
        table_full=False,
    )
    return OfferFacts(**{**base, **kw})


def _entry(*events, prefill_host="10.0.0.1", skip=1):
    table = RecvTable(Timeouts(hold_s=60.0))
    entry = None
    for event in events:
        entry = table.apply("k", event, 0.0, deadline=30.0)
        if event is Event.EXPECT:
            entry.skip_blocks, entry.prompt_digest = skip, DIGEST
            entry.prefill_host, entry.load_deadline = prefill_host, 30.0
    return entry


def test_an_offer_nobody_asked_for_is_accepted_whole():
    decision = decide_offer(None, _facts())
    assert decision.answer is OfferAnswer.ACCEPT
    assert decision.skip_blocks == 0 and decision.deadline is None


def test_an_expected_offer_skips_what_the_decode_holds():
    decision = decide_offer(_entry(Event.EXPECT, skip=2), _facts())
    assert decision.answer is OfferAnswer.ACCEPT
    assert decision.skip_blocks == 2 and decision.deadline == 30.0
    # at least one block always comes
    decision = decide_offer(_entry(Event.EXPECT, skip=9), _facts())
    assert decision.skip_blocks == 3


@pytest.mark.parametrize(
    "entry, facts, kind",
    [
        (None, _facts(channel_ok=False), Refusal.UNKNOWN_CHANNEL),
        (None, _facts(num_blocks=65), Refusal.OVERSIZED),
        ((Event.OFFER,), _facts(), Refusal.DUPLICATE),
        ((Event.OFFER, Event.ABANDON), _facts(), Refusal.DUPLICATE),
        ((Event.OFFER, Event.RECEIVED), _facts(), Refusal.DUPLICATE),
        (None, _facts(table_full=True), Refusal.BUSY),
        ((Event.EXPECT,), _facts(prompt_digest=OTHER), Refusal.DIGEST),
        # in that order: a bad channel first, a full table only for a new key
        (None, _facts(channel_ok=False, num_blocks=65), Refusal.UNKNOWN_CHANNEL),
        ((Event.OFFER,), _facts(table_full=True), Refusal.DUPLICATE),
    ],
)
def test_refused_offers(entry, facts, kind):
    decision = decide_offer(None if entry is None else _entry(*entry), facts)
    assert decision.answer is OfferAnswer.REFUSE and decision.refusal is kind
    assert decision.detail


def test_an_offer_of_a_key_given_up_on_is_not_wanted():
    for events in [(Event.ABANDON,), (Event.EXPECT, Event.ABANDON)]:
        decision = decide_offer(_entry(*events), _facts(table_full=True))
        assert decision.answer is OfferAnswer.NOT_WANTED


def test_another_prompts_kv_fails_the_load_only_from_the_named_prefill():
    entry = _entry(Event.EXPECT, prefill_host="10.0.0.1")
    named = decide_offer(entry, _facts(prompt_digest=OTHER, offered_by="10.0.0.1"))
    stranger = decide_offer(entry, _facts(prompt_digest=OTHER, offered_by="10.0.0.9"))
    assert named.fail_load and not stranger.fail_load
    nobody_named = _entry(Event.EXPECT, prefill_host="")
    decision = decide_offer(nobody_named, _facts(prompt_digest=OTHER, offered_by=""))
    assert decision.refusal is Refusal.DIGEST and not decision.fail_load


# --- the wire ------------------------------------------------------------------


def test_the_enums_and_the_reserved_offer_slot_encode_as_before():
    import msgspec

    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
        Offer,
        Reply,
        Status,
        refusal,
    )

    reply = Reply(req_no=1, status=Status.REJECTED, reason=Refusal.UNKNOWN_CHANNEL)
    assert msgspec.msgpack.encode(reply) == msgspec.msgpack.encode(
        ["reply", 1, "rejected", "unknown_channel", b"", 0]
    )
    assert refusal(reply) is Refusal.UNKNOWN_CHANNEL
    assert refusal(Reply(req_no=1, status=Status.REJECTED, reason="?")) is None
    assert refusal(Reply(req_no=1, status=Status.OK, reason="busy")) is None
    offer = Offer(req_no=2, channel_id="c", key="k", num_blocks=3, prompt_digest=DIGEST)
    assert msgspec.msgpack.encode(offer) == msgspec.msgpack.encode(
        ["offer", 2, "c", "k", 0, 3, DIGEST, ""]
    )
