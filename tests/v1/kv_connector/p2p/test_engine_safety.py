"""The P2P engine when a party misbehaves: strangers, wrong KV, dead peers.

Each test is one finding of the xPyD safety review (issue 17) and fails on
the code before the fix: KV of another prompt filed under a key, a refused
Hello that told a stranger the layout, a never-held GET key blocking every
other GET of its prefill, a second GET hold orphaning the first, threads
and sockets of dead peers never reclaimed, a Hello flood starting a thread
each, and an offer racing a channel break stranding its slot.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
    SlotState,
    limits,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Hello,
    Offer,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.fake import (
    FakeTransport,
)

from .test_engine import (
    DIGEST,
    HOST,
    assert_nothing_allocated,
    deadline,
    receive,
    send,
    wait_done,
    wait_for,
    wait_slot,
)

OTHER_DIGEST = proto.prompt_digest(list(range(1, 101)))


class Stranger:
    """A bare ZMQ DEALER speaking the control protocol without the secret."""

    def __init__(self, addr: str, secret: bytes | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{addr}")
        self.secret = secret

    def ask(self, msg, timeout_s: float = 2.0) -> Reply | None:
        self.sock.send_multipart(proto.seal(self.secret, msg))
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return proto.open_frame(self.secret, self.sock.recv_multipart())

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


_fake = FakeTransport(torch.device("cpu"), HOST)


def hello(
    decode, *, channel_id: str = "c0ffee", sender: str = "127.0.0.1:1", **kw
) -> Hello:
    """A Hello with a fresh fake-transport token (the stranger never joins)."""
    setup, _ = _fake.initiate()
    fields = dict(
        version=proto.PROTOCOL_VERSION,
        req_no=1,
        sender_addr=sender,
        channel_id=channel_id,
        transport="fake",
        setup=setup,
        layout=decode.engine.layout.spec,
        send_type="PUT_ASYNC",
        sent_at=time.time(),
    )
    fields.update(kw)
    return Hello(**fields)


def joined_hello(stranger: Stranger, decode, channel_id: str = "c0ffee"):
    """Open a channel as a stranger would, joining its data side."""
    setup, finish = _fake.initiate()
    reply = stranger.ask(hello(decode, channel_id=channel_id, setup=setup))
    assert reply.status == Status.OK
    return finish(reply.setup, deadline(5.0))


# --- wrong KV ------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["fake", "tcp"])
def test_offer_of_another_prompt_is_refused_and_the_load_fails_at_once(
    make_engine, transport
):
    """HTTP-only poisoning: prompt A prefilled, prompt B decoded under one key."""
    prefill = make_engine(transport, "PUT", seed=1)
    decode = make_engine(transport, "PUT", seed=2)
    before = [t.clone() for t in decode.layers]
    decode.expect(
        "k",
        0,
        deadline(30.0),
        get_from=None,
        prompt_digest=DIGEST,
        prefill_addr=prefill.addr,
    )  # the named prefill itself sends it
    xfer = prefill.start_send(
        "k", "req-k", decode.addr, [1, 2, 3], all_saved=True, prompt_digest=OTHER_DIGEST
    )
    assert not wait_done(xfer).ok
    slot = wait_slot(decode, "k", timeout=5.0)  # fails now, not after 30 s
    assert slot.state is SlotState.FAILED and "digest" in slot.reason
    decode.release(slot)
    assert decode.totals()["digest_mismatches"] == 1
    assert all((a == b).all() for a, b in zip(before, decode.layers))
    assert_nothing_allocated(decode)


def test_a_wrong_digest_from_another_host_does_not_kill_the_load(make_engine):
    """Only refused: the prefill the request named (on another host here) may
    still send the right KV, which then lands."""
    intruder = make_engine("fake", "PUT", seed=1)
    prefill = make_engine("fake", "PUT", seed=3)
    decode = make_engine("fake", "PUT", seed=2)
    decode.expect(
        "k",
        0,
        deadline(30.0),
        get_from=None,
        prompt_digest=DIGEST,
        prefill_addr="127.0.0.9:21001",
    )
    bad = intruder.start_send(
        "k", "r", decode.addr, [1, 2], all_saved=True, prompt_digest=OTHER_DIGEST
    )
    assert not wait_done(bad).ok and "digest" in bad.reason
    assert decode.poll("k") is None  # still waiting
    good = prefill.start_send(
        "k", "r", decode.addr, [1, 2], all_saved=True, prompt_digest=DIGEST
    )
    assert wait_done(good).ok
    receive(decode, "k", [40, 41], 0)


def test_kv_received_before_the_request_keeps_the_senders_digest(make_engine):
    """PUT_ASYNC can deliver before decode knows the request: the worker then
    compares the slot's digest with its own request's (worker.py)."""
    prefill = make_engine("fake", "PUT", seed=1)
    decode = make_engine("fake", "PUT", seed=2)
    xfer = send(prefill, decode, "k", [1, 2], mode="PUT", expect=False)
    assert wait_done(xfer).ok
    decode.expect("k", 0, deadline(), get_from=None, prompt_digest=OTHER_DIGEST)
    slot = wait_slot(decode, "k")
    assert (
        slot.state is SlotState.COMPLETE
        and slot.prompt_digest == DIGEST != OTHER_DIGEST
    )
    decode.release(slot)


# --- what a stranger learns and costs -------------------------------------------


def test_a_hello_or_get_naming_another_machine_is_refused(make_engine):
    """The address a message names for replies, data and pulled KV must be the
    machine it came from (gloo and nccl acceptors connect to it; a Get's KV
    is sent to it)."""
    decode = make_engine("fake", "PUT_ASYNC")
    stranger = Stranger(decode.addr)
    try:
        reply = stranger.ask(hello(decode, sender="10.9.9.9:21001"))
        assert reply.status == Status.REJECTED and reply.reason == "address"
        reply = stranger.ask(
            proto.Get(req_no=5, sender_addr="10.9.9.9:22001", key="k", skip_blocks=0)
        )
        assert reply.status == Status.REJECTED and reply.reason == "address"
    finally:
        stranger.close()
    assert not decode.engine.receiver.inbound


def test_a_refused_hello_names_the_kind_only(make_engine):
    decode = make_engine("fake", "PUT_ASYNC")
    stranger = Stranger(decode.addr)
    try:
        spec = decode.engine.layout.spec
        wrong = proto.LayoutSpec(
            num_layers=spec.num_layers + 1,
            page_bytes=spec.page_bytes,
            block_size=spec.block_size,
            dtype=spec.dtype,
        )
        reply = stranger.ask(hello(decode, layout=wrong))
        assert reply.status == Status.REJECTED and reply.reason == "layout"
        reply = stranger.ask(hello(decode, send_type="GET"))
        assert reply.reason == "send_type"
    finally:
        stranger.close()


def test_a_hello_without_the_secret_gets_no_reply_and_no_thread(make_engine):
    decode = make_engine("fake", "PUT_ASYNC", secret=b"fleet")
    threads = threading.active_count()
    stranger = Stranger(decode.addr, secret=b"guess")
    try:
        assert stranger.ask(hello(decode), timeout_s=0.5) is None
    finally:
        stranger.close()
    assert decode.totals()["rejected_messages"] == 1
    assert threading.active_count() == threads and not decode.engine.receiver.inbound


def test_hello_flood_is_capped(make_engine, monkeypatch):
    monkeypatch.setattr(limits, "MAX_INBOUND_CHANNELS", 8)
    decode = make_engine("fake", "PUT_ASYNC")
    threads = threading.active_count()
    stranger = Stranger(decode.addr)
    try:
        replies = [
            stranger.ask(hello(decode, channel_id=f"c{i}", sender=f"127.0.0.1:{i + 1}"))
            for i in range(40)
        ]
    finally:
        stranger.close()
    assert [r.status for r in replies].count(Status.OK) == 8
    assert {r.reason for r in replies if r.status != Status.OK} == {"busy"}
    assert len(decode.engine.receiver.inbound) == 8
    assert threading.active_count() <= threads + 8


def test_replacing_channels_cannot_pile_up_threads(make_engine, monkeypatch):
    """One sender address, many Hellos that never join: each replaces the last,
    but the replaced ones' threads still wait for their set-up; the cap counts
    threads, so a flood under one address is bounded too."""
    monkeypatch.setattr(limits, "MAX_INBOUND_CHANNELS", 8)
    decode = make_engine("fake", "PUT_ASYNC")
    threads = threading.active_count()
    stranger = Stranger(decode.addr)
    try:
        replies = [stranger.ask(hello(decode, channel_id=f"c{i}")) for i in range(40)]
    finally:
        stranger.close()
    assert [r.status for r in replies].count(Status.OK) == 8
    assert threading.active_count() <= threads + 8


def test_a_new_channel_from_a_sender_replaces_its_old_one_once_set_up(make_engine):
    decode = make_engine("fake", "PUT_ASYNC")
    stranger = Stranger(decode.addr)
    try:
        for i in range(5):  # a prefill that restarted five times
            joined_hello(stranger, decode, channel_id=f"c{i}")
            wait_for(
                lambda i=i: list(decode.engine.receiver.inbound) == [f"c{i}"],
                "one channel per sender",
            )
        # A Hello that never completes its set-up (a replay) replaces nothing.
        assert stranger.ask(hello(decode, channel_id="never")).status == Status.OK
        time.sleep(0.3)
        assert (
            "c4" in decode.engine.receiver.inbound
            and not decode.engine.receiver.inbound["c4"].broken
        )
    finally:
        stranger.close()


def test_a_replayed_or_stale_hello_is_refused(make_engine):
    decode = make_engine("fake", "PUT_ASYNC")
    stranger = Stranger(decode.addr)
    try:
        first = hello(decode, channel_id="once")
        assert stranger.ask(first).status == Status.OK
        assert stranger.ask(first).reason == "duplicate"
        old = hello(
            decode, channel_id="old", sent_at=time.time() - 2 * limits.MAX_HELLO_AGE_S
        )
        assert stranger.ask(old).reason == "stale"
    finally:
        stranger.close()


@pytest.mark.parametrize("prefill_ahead", [True, False])
def test_any_pair_the_router_accepts_can_open_a_channel(make_engine, prefill_ahead):
    """One clock rule (issue 28): the router accepted clocks 300 s off its
    own, a decode refused Hellos 300 s off its own, so a prefill and a
    decode at opposite ends of the router's window were paired and every
    send refused. Both at the very ends now (and a few seconds in flight):
    the Hello is accepted; one further off is refused by the router."""
    from vllm_disagg.wire.discovery import (
        DISCOVERY_VERSION,
        MAX_CLOCK_SKEW_S,
        DiscoveryError,
        Register,
        Role,
        open_frame,
        seal,
    )

    router_now = time.time()
    sign = 1 if prefill_ahead else -1
    prefill_clock = router_now + sign * MAX_CLOCK_SKEW_S
    decode_clock = router_now - sign * MAX_CLOCK_SKEW_S

    def registers(sent_at: float, port: int) -> bool:
        msg = Register(
            DISCOVERY_VERSION,
            f"i{port}",
            Role.PREFILL,
            f"127.0.0.1:{port}",
            f"127.0.0.1:{port + 1}",
            "m",
            sent_at=sent_at,
        )
        try:
            open_frame(b"t", seal(b"t", msg), now=router_now)
        except DiscoveryError:
            return False
        return True

    assert registers(prefill_clock, 20001) and registers(decode_clock, 20003)
    assert not registers(router_now + sign * (MAX_CLOCK_SKEW_S + 1), 20005)

    decode = make_engine("fake", "PUT_ASYNC")
    stranger = Stranger(decode.addr)
    try:
        # The decode's clock is decode_clock - router_now off the test's.
        in_flight_s = 5.0
        sent_at = time.time() + (prefill_clock - decode_clock) - sign * in_flight_s
        reply = stranger.ask(hello(decode, channel_id="skewed", sent_at=sent_at))
        assert reply.status == Status.OK, reply
    finally:
        stranger.close()


def test_an_offer_must_come_on_its_channels_own_connection(make_engine):
    """Channel ids travel in clear: an offer naming someone else's channel from
    another control connection would steal that sender's next transfer."""
    decode = make_engine("fake", "PUT_ASYNC")
    owner, thief = Stranger(decode.addr), Stranger(decode.addr)
    try:
        joined_hello(owner, decode, channel_id="theirs")
        wait_for(
            lambda: decode.engine.receiver.inbound["theirs"].channel is not None,
            "channel up",
        )
        reply = thief.ask(
            Offer(
                req_no=2,
                channel_id="theirs",
                key="stolen",
                xfer_id=0,
                num_blocks=1,
                prompt_digest=DIGEST,
            )
        )
        assert reply.status == Status.REJECTED and reply.reason == "unknown_channel"
        assert decode.engine.receiver.table.state("stolen") is None
    finally:
        owner.close()
        thief.close()


def test_a_channel_whose_sender_died_is_reclaimed(make_engine):
    """tcp: a killed prefill left a CLOSE_WAIT socket and a thread per lifetime."""
    decode = make_engine("tcp", "PUT")
    senders = []
    for seed in range(3):
        prefill = make_engine("tcp", "PUT", seed=seed)
        senders.append(f"p2p-recv-{prefill.addr}")
        xfer = send(prefill, decode, f"k{seed}", [1, 2], mode="PUT")
        assert wait_done(xfer).ok
        receive(decode, f"k{seed}", [10, 11], 0)
        prefill.engine.close()  # its sockets close, as when the process dies
    wait_for(
        lambda: not decode.engine.receiver.inbound,
        "inbound channels of dead senders closed",
        timeout=3 * limits.IDLE_CHECK_INTERVAL_S + 5,
    )
    alive = [t.name for t in threading.enumerate() if t.name in senders]
    assert not alive, alive


def test_idle_peer_threads_retire(make_engine, monkeypatch):
    """50 decodes that died left 50 live sender threads on the prefill."""
    monkeypatch.setattr(limits, "PEER_IDLE_S", 0.3)
    # The hold also bounds the later live transfer (its Hello and offer): 0.3 s
    # was missed once at a load average of 9 with correct code.
    prefill = make_engine("fake", "PUT", hold=2.0)
    dead = [f"127.0.0.{i + 1}:9" for i in range(50)]  # nothing listens on port 9
    xfers = [
        prefill.start_send(
            f"k{i}", f"r{i}", addr, [1], all_saved=True, prompt_digest=DIGEST
        )
        for i, addr in enumerate(dead)
    ]
    for xfer in xfers:
        assert not wait_done(xfer).ok
    wait_for(lambda: not prefill.engine._peers, "peer threads retired", timeout=10.0)
    wait_for(
        lambda: not [
            t for t in threading.enumerate() if t.name.startswith("p2p-peer-")
        ],
        "peer threads exited",
        timeout=10.0,
    )
    # A later transfer to a live peer starts a fresh thread and works.
    decode = make_engine("fake", "PUT")
    assert wait_done(send(prefill, decode, "later", [1, 2], mode="PUT")).ok


# --- GET ---------------------------------------------------------------------


def test_a_key_the_prefill_never_holds_does_not_delay_other_gets(make_engine):
    prefill = make_engine("fake", "GET", seed=1)
    decode = make_engine("fake", "GET", seed=2)
    decode.expect(
        "never", 0, deadline(5.0), get_from=prefill.addr, prompt_digest=DIGEST
    )
    time.sleep(0.2)  # its Get is being answered "not ready" over and over
    start = time.monotonic()
    send(prefill, decode, "good", [1, 2, 3], mode="GET")
    receive(decode, "good", [20, 21, 22], 0)
    assert time.monotonic() - start < 2.0  # was the never-held key's whole deadline
    decode.abandon("never")


def test_a_second_hold_of_a_key_ends_the_first(make_engine):
    prefill = make_engine("fake", "GET", hold=30.0)
    first = prefill.hold("k", "req-1", [1, 2], prompt_digest=DIGEST)
    second = prefill.hold("k", "req-2", [3, 4], prompt_digest=DIGEST)
    assert wait_done(first, timeout=1.0).ok is False and "replaced" in first.reason
    assert not second.done.is_set()
    assert {x.request_id for x in prefill.take_finished_sends()} == {"req-1"}
    assert prefill.totals()["failed_sends"] == 1


# --- the offer / channel-break race ---------------------------------------------


def test_an_offer_racing_a_channel_break_never_strands_its_slot(
    make_engine, monkeypatch
):
    """The channel breaks while the offer's room is being taken: the slot must
    be failed or never made, and its bytes returned (was RECEIVING forever)."""
    decode = make_engine("fake", "PUT_ASYNC")
    stranger = Stranger(decode.addr)
    real_allocate = decode.engine.receiver.room.allocate

    def allocate_while_breaking(nbytes):
        room = real_allocate(nbytes)
        [inbound] = decode.engine.receiver.inbound.values()
        inbound.break_("broken during the offer")
        return room

    try:
        joined_hello(stranger, decode)
        wait_for(
            lambda: decode.engine.receiver.inbound["c0ffee"].channel is not None,
            "channel up",
        )
        monkeypatch.setattr(
            decode.engine.receiver.room, "allocate", allocate_while_breaking
        )
        reply = stranger.ask(
            Offer(
                req_no=2,
                channel_id="c0ffee",
                key="k",
                xfer_id=0,
                num_blocks=2,
                prompt_digest=DIGEST,
            )
        )
    finally:
        stranger.close()
    assert reply.status == Status.REJECTED and reply.reason == "unknown_channel"
    with decode.engine._lock:
        assert decode.engine.receiver.table.state("k") is None  # never filed
    assert decode.occupancy() == (0, 0)


def test_a_pulled_send_that_fails_before_its_offer_fails_the_load_now(make_engine):
    """GET: the prefill's send to the decode fails (here its Hello is refused
    for a layout mismatch) after the Get was accepted. The decode asks again
    while no offer comes and is told "gone": it recomputes now, not at its
    kv_load_timeout_s (30 s here)."""
    prefill = make_engine("fake", "GET", seed=1)
    decode = make_engine("fake", "GET", seed=2, layers=2)
    xfer = prefill.hold("k", "req-k", [1, 2], prompt_digest=DIGEST)
    start = time.monotonic()
    decode.expect("k", 0, deadline(30.0), get_from=prefill.addr, prompt_digest=DIGEST)
    assert not wait_done(xfer).ok
    slot = wait_slot(decode, "k", timeout=3 * limits.GET_CONFIRM_INTERVAL_S + 5)
    assert slot.state is SlotState.FAILED and Status.GONE in slot.reason
    assert time.monotonic() - start < 10.0
    decode.release(slot)


def test_a_silent_peer_costs_one_bounded_wait_and_stalls_no_other_peer(
    make_engine, monkeypatch
):
    """A decode that died (its port open, nobody answering) held every send to
    it for kv_hold_timeout_s; sends to a live decode must not wait for it."""
    monkeypatch.setattr(limits, "CONTROL_REPLY_TIMEOUT_S", 0.5)
    prefill = make_engine("fake", "PUT_ASYNC", hold=30.0, seed=1)
    live = make_engine("fake", "PUT_ASYNC", seed=2)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        start = time.monotonic()
        first = prefill.start_send(
            "d1", "r1", f"127.0.0.1:{port}", [1], all_saved=True, prompt_digest=DIGEST
        )
        good = send(prefill, live, "ok", [1, 2], mode="PUT")
        receive(live, "ok", [30, 31], 0)
        assert wait_done(good).ok and time.monotonic() - start < 3.0
        assert not wait_done(first).ok and "no reply to Hello" in first.reason
        assert time.monotonic() - start < 5.0  # not kv_hold_timeout_s (30 s)
        # Within PEER_RETRY_AFTER_S the next send to it fails at once.
        again = prefill.start_send(
            "d2", "r2", f"127.0.0.1:{port}", [1], all_saved=True, prompt_digest=DIGEST
        )
        t = time.monotonic()
        assert not wait_done(again).ok and "unanswered" in again.reason
        assert time.monotonic() - t < 1.0
    finally:
        silent.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("arrived_first", [False, True], ids=["refused", "freed"])
def test_an_unwanted_key_is_refused_or_freed_at_once(make_engine, arrived_first):
    """prompt_logprobs on the decode: its worker abandons the key; an offer
    that comes later is answered not_wanted (the prefill frees its blocks),
    KV that came first is freed now, not kv_hold_timeout_s later."""
    prefill = make_engine("fake", "PUT", seed=1)
    decode = make_engine("fake", "PUT", seed=2, hold=60.0)
    if arrived_first:
        assert wait_done(
            send(prefill, decode, "k", [1, 2], mode="PUT", expect=False)
        ).ok
        wait_for(
            lambda: decode.engine.receiver.table.state("k") is not None
            and decode.engine.receiver.table.state("k").value == "ready",
            "the unexpected slot",
        )
        decode.abandon("k")
        assert decode.occupancy() == (0, 0)
    else:
        decode.abandon("k")
        xfer = send(prefill, decode, "k", [1, 2], mode="PUT", expect=False)
        assert not wait_done(xfer).ok and "not_wanted" in xfer.reason
        assert decode.occupancy() == (0, 0)
