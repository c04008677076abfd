"""The P2P engine, two (or three) real engines in one process over loopback.

Fake KV caches (3 layers x 64 blocks of [1, 32, 128]) stand in for the model;
the tests drive the engine API the worker uses (start_send / layer_saved /
hold on the sender, expect / poll / copy_into_cache / release / abandon on
the receiver) and check bytes, stats and memory accounting exactly.
Every wait is bounded; every engine is closed by the ``make_engine`` fixture
(conftest.py).
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections import Counter

import msgspec
import pytest
import torch
import zmq

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
    KVLayout,
    P2pEngine,
    RecvSlot,
    SendTransfer,
    SlotState,
    limits,
    zmq_endpoint,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.core import (
    logger as engine_logger,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.inbound import (
    InboundChannel,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    Hello,
    LayoutSpec,
    Offer,
    Reply,
    Status,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.recv_state import RecvState
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import COUNTERS
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import (
    TransportError,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.fake import (
    FakeTransport,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.tcp import (
    TcpChannel,
)

LAYERS = 3
BLOCKS = 64
BLOCK_SHAPE = (1, 32, 128)
BLOCK_SIZE = 32
PAGE = 32 * 128 * 4  # bytes of one float32 block of one layer
HOST = "127.0.0.1"
WAIT_S = 10.0  # upper bound of any wait for something that should happen soon

TRANSPORTS = ["fake", "tcp"]
DIGEST = proto.prompt_digest(list(range(100)))  # every transfer here is of one prompt


class Node:
    """An engine, its fake KV cache and its stats totals (take() drains them)."""

    def __init__(self, engine: P2pEngine, kv: dict[str, torch.Tensor]):
        self.engine = engine
        self.kv = kv
        self.layers = list(kv.values())
        self._totals: Counter = Counter()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def totals(self) -> Counter:
        snap = self.engine.stats.take()
        if snap is not None:
            for key in COUNTERS:
                self._totals[key] += snap.data[key]
        return Counter(self._totals)

    def block_bytes(self, layer: int, block_ids: list[int]) -> torch.Tensor:
        return self.layers[layer][block_ids].contiguous().view(torch.uint8).clone()


# --- helpers -----------------------------------------------------------------


def wait_for(pred, what: str, timeout: float = WAIT_S):
    end = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def wait_slot(node: Node, key: str, timeout: float = WAIT_S):
    return wait_for(lambda: node.poll(key), f"slot {key}", timeout)


def _nbytes(part: torch.Tensor | memoryview) -> int:
    if isinstance(part, memoryview):
        return part.nbytes
    return part.numel() * part.element_size()


def wait_done(xfer: SendTransfer, timeout: float = WAIT_S) -> SendTransfer:
    assert xfer.done.wait(timeout), f"send of {xfer.key} did not finish in {timeout}s"
    return xfer


def deadline(seconds: float = WAIT_S) -> float:
    return time.monotonic() + seconds


def assert_blocks_equal(
    dst: Node, dst_ids: list[int], src: Node, src_ids: list[int]
) -> None:
    for layer in range(len(src.layers)):
        got = dst.block_bytes(layer, dst_ids)
        want = src.block_bytes(layer, src_ids)
        assert torch.equal(got, want), (
            f"layer {layer}: blocks {dst_ids} != source {src_ids}"
        )


def open_keys(node: Node) -> dict[str, RecvState]:
    """Receive-side keys not closed yet (closed ones only refuse late offers)."""
    with node.engine._lock:
        return {
            k: e.state
            for k, e in node.engine.receiver.table.keys.items()
            if e.state is not RecvState.CLOSED
        }


def assert_nothing_held(node: Node) -> None:
    assert node.occupancy() == (0, 0)
    assert not open_keys(node), open_keys(node)


def assert_nothing_allocated(node: Node) -> None:
    assert node.occupancy() == (0, 0)
    with node.engine._lock:
        assert not [
            k for k, e in node.engine.receiver.table.keys.items() if e.slot is not None
        ]


def send(
    sender: Node,
    receiver: Node,
    key: str,
    src_ids: list[int],
    *,
    mode: str,
    skip: int = 0,
    expect: bool = True,
    exp_deadline: float | None = None,
):
    """Start one transfer in ``mode``; returns the sender's SendTransfer."""
    if mode == "GET":
        xfer = sender.hold(key, f"req-{key}", src_ids, prompt_digest=DIGEST)
        receiver.expect(
            key,
            skip,
            exp_deadline or deadline(),
            get_from=sender.addr,
            prompt_digest=DIGEST,
        )
        return xfer
    if expect:
        receiver.expect(
            key, skip, exp_deadline or deadline(), get_from=None, prompt_digest=DIGEST
        )
    xfer = sender.start_send(
        key,
        f"req-{key}",
        receiver.addr,
        src_ids,
        all_saved=mode == "PUT",
        prompt_digest=DIGEST,
    )
    if mode == "PUT_ASYNC":
        for layer in range(sender.engine.layout.num_layers):
            xfer.layer_saved(layer, None)
    return xfer


def receive(receiver: Node, key: str, dst_ids: list[int], first_block: int):
    slot = wait_slot(receiver, key)
    assert slot.state is SlotState.COMPLETE, (slot.state, slot.reason)
    receiver.copy_into_cache(slot, dst_ids, first_block)
    receiver.release(slot)
    return slot


class WarningCounter(logging.Handler):
    """Counts the engine logger's warning lines (vLLM's loggers do not propagate)."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        engine_logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        engine_logger.removeHandler(self)


# --- the three send modes ----------------------------------------------------


@pytest.mark.parametrize("skip", [0, 2])
@pytest.mark.parametrize("mode", ["PUT_ASYNC", "PUT", "GET"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_transfer_lands_byte_equal(make_engine, transport, mode, skip):
    prefill = make_engine(transport, mode, seed=1)
    decode = make_engine(transport, mode, seed=2)
    src = [5, 7, 9, 11, 13]
    dst = [40, 41, 42, 43, 44][skip:]
    before = [t.clone() for t in decode.layers]
    held = len(src) - skip
    nbytes = LAYERS * held * PAGE

    if mode == "PUT_ASYNC":
        # layers are saved one by one from this (the model) thread; the
        # transfer cannot complete before the last one is saved
        decode.expect("k", skip, deadline(), get_from=None, prompt_digest=DIGEST)
        xfer = prefill.start_send(
            "k", "req-k", decode.addr, src, all_saved=False, prompt_digest=DIGEST
        )
        xfer.layer_saved(0, None)
        wait_for(lambda: decode.occupancy() == (nbytes, 0), "the offer to reserve room")
        xfer.layer_saved(1, None)
        time.sleep(0.15)
        assert decode.poll("k") is None
        assert not xfer.done.is_set()
        xfer.layer_saved(2, None)
    else:
        xfer = send(prefill, decode, "k", src, mode=mode, skip=skip)

    slot = wait_slot(decode, "k")
    assert slot.state is SlotState.COMPLETE, slot.reason
    assert (slot.num_blocks, slot.skip_blocks, slot.blocks_held) == (
        len(src),
        skip,
        held,
    )
    assert decode.occupancy() == (nbytes, 0)
    decode.copy_into_cache(slot, dst, skip)
    decode.release(slot)
    assert_nothing_held(decode)

    assert_blocks_equal(decode, dst, prefill, src[skip:])
    untouched = [b for b in range(BLOCKS) if b not in dst]
    for layer in range(LAYERS):
        assert torch.equal(decode.layers[layer][untouched], before[layer][untouched])
    assert_blocks_equal(prefill, src, prefill, src)  # the source is left as it was

    assert wait_done(xfer).ok, xfer.reason
    assert prefill.take_finished_sends() == [xfer]
    got, sent = decode.totals(), prefill.totals()
    assert got["blocks_received"] == held and got["bytes_received"] == nbytes
    assert sent["blocks_sent"] == held and sent["bytes_sent"] == nbytes
    for node in (got, sent):
        assert node["failed_sends"] == node["rejected_messages"] == node["dropped"] == 0
        assert node["spills"] == 0


@pytest.mark.parametrize(
    "per_message, messages", [(1, 3), (2, 2), (3, 1)], ids=["1", "2", "3"]
)
@pytest.mark.parametrize("mode", ["PUT_ASYNC", "GET"])
def test_layers_travel_in_the_messages_both_sides_compute(
    make_engine, monkeypatch, mode, per_message, messages
):
    # protocol.layer_groups: runs of ``per_message`` layers of this transfer,
    # each one channel message; PUT_ASYNC sends a run once its last layer is saved.
    held = 4
    monkeypatch.setattr(proto, "LAYER_MESSAGE_BYTES", per_message * held * PAGE)
    sizes: list[int] = []
    real_send = TcpChannel.send

    def counting_send(channel, tensors, deadline):
        sizes.append(sum(_nbytes(t) for t in tensors))
        real_send(channel, tensors, deadline)

    monkeypatch.setattr(TcpChannel, "send", counting_send)
    prefill = make_engine("tcp", mode, seed=1)
    decode = make_engine("tcp", mode, seed=2)
    src, dst = [2, 4, 6, 8], [20, 21, 22, 23]
    if mode == "PUT_ASYNC":
        decode.expect("k", 0, deadline(), get_from=None, prompt_digest=DIGEST)
        xfer = prefill.start_send(
            "k", "req-k", decode.addr, src, all_saved=False, prompt_digest=DIGEST
        )
        for layer in range(LAYERS):
            time.sleep(0.05)
            if layer < per_message:
                assert sizes == [], "a run left before its last layer was saved"
            xfer.layer_saved(layer, None)
    else:
        xfer = send(prefill, decode, "k", src, mode=mode)
    receive(decode, "k", dst, 0)
    assert wait_done(xfer).ok, xfer.reason
    assert_blocks_equal(decode, dst, prefill, src)
    layer_bytes = held * PAGE
    runs = [len(g) for g in proto.layer_groups(LAYERS, layer_bytes)]
    assert len(runs) == messages
    assert sizes == [n * layer_bytes for n in runs]
    assert_nothing_held(decode)


def test_bf16_blocks_and_a_capped_skip(make_engine):
    # bf16 KV, and a decode claiming to hold every block: the receiver caps the
    # skip so that at least the last block is always sent
    prefill = make_engine("fake", "PUT", dtype=torch.bfloat16, seed=3)
    decode = make_engine("fake", "PUT", dtype=torch.bfloat16, seed=4)
    src = [1, 2, 3]
    xfer = send(prefill, decode, "k", src, mode="PUT", skip=5)
    slot = wait_slot(decode, "k")
    assert slot.state is SlotState.COMPLETE and slot.skip_blocks == 2
    with pytest.raises(ValueError):
        decode.copy_into_cache(slot, [60, 61], 1)  # more blocks than were sent
    decode.copy_into_cache(slot, [60], 2)
    decode.release(slot)
    assert_blocks_equal(decode, [60], prefill, [3])
    assert wait_done(xfer).ok
    assert decode.totals()["bytes_received"] == LAYERS * 32 * 128 * 2
    assert_nothing_held(decode)


# --- receive buffer and pool -------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tiny_buffer_spills_to_the_pool(make_engine, transport):
    prefill = make_engine(transport, "PUT", seed=1)
    decode = make_engine(transport, "PUT", buf=1, pool=1 << 22, seed=2)
    src, dst = [3, 4, 5, 6], [10, 11, 12, 13]
    nbytes = LAYERS * len(src) * PAGE
    xfer = send(prefill, decode, "k", src, mode="PUT")
    slot = wait_slot(decode, "k")
    assert slot.state is SlotState.COMPLETE, slot.reason
    assert slot.pool_alloc is not None
    buffer_used, pool_used = decode.occupancy()
    assert buffer_used == 0 and pool_used >= nbytes
    decode.copy_into_cache(slot, dst, 0)
    decode.release(slot)
    assert_blocks_equal(decode, dst, prefill, src)
    assert_nothing_held(decode)
    assert wait_done(xfer).ok
    got = decode.totals()
    assert (
        got["spills"] == 1 and got["bytes_received"] == nbytes and got["dropped"] == 0
    )


def test_buffer_first_then_pool_accounting_is_exact(make_engine):
    nbytes = LAYERS * 2 * PAGE
    prefill = make_engine("fake", "PUT", seed=1)
    decode = make_engine("fake", "PUT", buf=nbytes, pool=1 << 22, seed=2)
    x1 = send(prefill, decode, "a", [1, 2], mode="PUT")
    s1 = wait_slot(decode, "a")
    x2 = send(prefill, decode, "b", [3, 4], mode="PUT")
    s2 = wait_slot(decode, "b")
    assert s1.state is s2.state is SlotState.COMPLETE
    assert s1.pool_alloc is None and s2.pool_alloc is not None
    assert decode.occupancy() == (nbytes, s2.pool_alloc.size)
    decode.copy_into_cache(s2, [20, 21], 0)
    decode.release(s2)
    assert decode.occupancy() == (nbytes, 0)
    # the buffer is free again: the next transfer does not spill
    x3 = send(prefill, decode, "c", [5, 6], mode="PUT")
    decode.release(s1)
    s3 = wait_slot(decode, "c")
    decode.copy_into_cache(s3, [22, 23], 0)
    decode.release(s3)
    assert_nothing_held(decode)
    assert_blocks_equal(decode, [20, 21, 22, 23], prefill, [3, 4, 5, 6])
    assert all(wait_done(x).ok for x in (x1, x2, x3))
    assert decode.totals()["spills"] == 1


@pytest.mark.parametrize("mode", ["PUT", "GET"])
def test_no_room_sender_gets_no_space_and_nothing_is_held(make_engine, mode):
    prefill = make_engine("fake", mode, seed=1)
    decode = make_engine("fake", mode, buf=1, pool=0, seed=2)
    xfer = send(prefill, decode, "k", [1, 2, 3], mode=mode)
    assert not wait_done(xfer).ok
    assert Status.NO_SPACE in xfer.reason
    got = decode.totals()
    assert got["dropped"] == 1 and got["blocks_received"] == 0
    assert got["rejected_messages"] == 0  # a full pool is not a bad message
    # decode learns at once (not at its deadline) that the load failed
    slot = wait_slot(decode, "k")
    assert slot.state is SlotState.FAILED and "no room" in slot.reason
    decode.release(slot)
    assert_nothing_held(decode)


def test_an_offer_for_an_abandoned_key_is_not_wanted(make_engine):
    prefill = make_engine("fake", "PUT", seed=1)
    decode = make_engine("fake", "PUT", seed=2)
    decode.expect("k", 0, time.monotonic() + 5, None, prompt_digest=DIGEST)
    decode.abandon("k")
    xfer = prefill.start_send(
        "k", "req-k", decode.addr, [1, 2, 3], all_saved=True, prompt_digest=DIGEST
    )
    assert not wait_done(xfer).ok and Status.NOT_WANTED in xfer.reason
    assert_nothing_held(decode)


def test_no_room_before_decode_expects_the_key_fails_its_load_at_once(make_engine):
    """PUT modes: the offer can beat decode's request; the failure waits for it."""
    prefill = make_engine("fake", "PUT", seed=1)
    decode = make_engine("fake", "PUT", buf=1, pool=0, seed=2)
    xfer = prefill.start_send(
        "k", "req-k", decode.addr, [1, 2], all_saved=True, prompt_digest=DIGEST
    )
    assert not wait_done(xfer).ok and Status.NO_SPACE in xfer.reason
    decode.expect("k", 0, time.monotonic() + 60, None, prompt_digest=DIGEST)
    slot = wait_slot(decode, "k", timeout=10.0)
    assert slot.state is SlotState.FAILED
    decode.release(slot)
    assert_nothing_held(decode)


def test_unclaimed_kv_makes_room_for_new_transfers_oldest_first(make_engine):
    """Issue 34: KV whose request the decode never saw (refused, cancelled)
    must not cost later transfers their room; the evicted key's request, if
    it comes after all, fails its load at once; claimed KV is never freed."""
    nbytes = LAYERS * 2 * PAGE
    prefill = make_engine("fake", "PUT", seed=1)
    decode = make_engine("fake", "PUT", buf=2 * nbytes, pool=0, seed=2)

    def offer(key, blocks):
        return prefill.start_send(
            key, f"req-{key}", decode.addr, blocks, all_saved=True, prompt_digest=DIGEST
        )

    # Nobody claims a or b; c needs their room: a, the oldest, goes.
    assert wait_done(offer("a", [1, 2])).ok
    assert wait_done(offer("b", [3, 4])).ok
    assert wait_done(offer("c", [5, 6])).ok
    got = decode.totals()
    assert got["unclaimed_evicted"] == 1 and got["dropped"] == 0
    decode.expect("a", 0, time.monotonic() + 60, None, prompt_digest=DIGEST)
    slot = wait_slot(decode, "a", timeout=5.0)
    assert slot.state is SlotState.FAILED and "no request claimed" in slot.reason
    decode.release(slot)
    # b and c are intact; once claimed, neither is freed for a newcomer.
    for key, src, dst in (("b", [3, 4], [20, 21]), ("c", [5, 6], [22, 23])):
        decode.expect(key, 0, time.monotonic() + 60, None, prompt_digest=DIGEST)
    slot_b = wait_slot(decode, "b")
    decode.copy_into_cache(slot_b, [20, 21], 0)
    decode.release(slot_b)
    # c is expected (READY, not yet taken): d gets b's room, and once d is
    # expected too, nothing is freed for e.
    assert wait_done(offer("d", [7, 8])).ok
    decode.expect("d", 0, time.monotonic() + 60, None, prompt_digest=DIGEST)
    late = offer("e", [9, 10])
    assert not wait_done(late).ok and Status.NO_SPACE in late.reason
    got = decode.totals()
    assert got["unclaimed_evicted"] == 1 and got["dropped"] == 1
    for key, dst in (("c", [22, 23]), ("d", [24, 25])):
        slot = wait_slot(decode, key)
        assert slot.state is SlotState.COMPLETE
        decode.copy_into_cache(slot, dst, 0)
        decode.release(slot)
    assert_blocks_equal(decode, [20, 21, 22, 23, 24, 25], prefill, [3, 4, 5, 6, 7, 8])


def test_a_flood_of_unclaimed_kv_costs_honest_transfers_nothing(make_engine):
    """Three unclaimed transfers (requests refused or cancelled after their
    prefill) for every honest one, into room for four: every honest transfer
    lands, and the room never holds more than it has."""
    nbytes = LAYERS * 2 * PAGE
    prefill = make_engine("fake", "PUT", seed=1)
    decode = make_engine("fake", "PUT", buf=4 * nbytes, pool=0, seed=2)
    for i in range(40):
        for j in range(3):
            flood = prefill.start_send(
                f"flood-{i}-{j}",
                "req",
                decode.addr,
                [1, 2],
                all_saved=True,
                prompt_digest=DIGEST,
            )
            assert wait_done(flood).ok
        key = f"honest-{i}"
        xfer = prefill.start_send(
            key, "req", decode.addr, [3, 4], all_saved=True, prompt_digest=DIGEST
        )
        assert wait_done(xfer).ok
        decode.expect(key, 0, time.monotonic() + 60, None, prompt_digest=DIGEST)
        slot = wait_slot(decode, key)
        assert slot.state is SlotState.COMPLETE, slot.reason
        decode.copy_into_cache(slot, [30, 31], 0)
        decode.release(slot)
        assert decode.occupancy()[0] <= 4 * nbytes
    assert_blocks_equal(decode, [30, 31], prefill, [3, 4])
    got = decode.totals()
    assert got["dropped"] == 0 and got["unclaimed_evicted"] >= 3 * 40 - 4


# --- deadlines ---------------------------------------------------------------


def test_an_expectation_nobody_serves_is_left_to_the_worker(make_engine):
    # The worker's deadline logic reports the load failure and abandons; the
    # engine expires an expectation only as a backstop, a grace period later.
    decode = make_engine("fake", "PUT_ASYNC", hold=0.2, seed=2)
    decode.expect("k", 1, deadline(0.1), get_from=None, prompt_digest=DIGEST)
    time.sleep(0.5)  # past the deadline and the hold timeout, two sweeps
    assert decode.poll("k") is None
    assert decode.engine.receiver.table.state("k") is RecvState.EXPECTED
    decode.abandon("k")
    assert_nothing_held(decode)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_key_abandoned_while_its_offer_takes_room_is_refused_and_freed(
    make_engine, transport
):
    """CI caught this interleaving: the worker gave up between the offer
    taking room and the slot being filed, and the bytes stayed held until
    the sweep (kv_hold_timeout_s later)."""
    prefill = make_engine(transport, "PUT_ASYNC", hold=5.0, seed=1)
    decode = make_engine(transport, "PUT_ASYNC", hold=30.0, seed=2)
    decode.expect("k", 0, deadline(30.0), get_from=None, prompt_digest=DIGEST)
    allocate = decode.engine.receiver.room.allocate

    def allocate_then_give_up(nbytes):
        room = allocate(nbytes)
        decode.abandon("k")
        return room

    decode.engine.receiver.room.allocate = allocate_then_give_up
    xfer = prefill.start_send(
        "k", "req-k", decode.addr, [1, 2, 3], all_saved=False, prompt_digest=DIGEST
    )
    assert not wait_done(xfer).ok
    assert "not_wanted" in xfer.reason.lower(), xfer.reason
    assert decode.occupancy() == (0, 0)
    assert decode.engine.receiver.table.state("k") is RecvState.CLOSED


@pytest.mark.parametrize("abandon", [False, True], ids=["release", "abandon"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layers_never_saved_fail_at_the_sender_deadline(
    make_engine, transport, abandon
):
    hold = 2.0  # the channel's set-up and the offer must fit in it on a loaded host
    prefill = make_engine(transport, "PUT_ASYNC", hold=hold, seed=1)
    decode = make_engine(transport, "PUT_ASYNC", hold=30.0, seed=2)
    src = [1, 2, 3]
    decode.expect(
        "k", 0, deadline(30.0), get_from=None, prompt_digest=DIGEST
    )  # the receiver waits long
    start = time.monotonic()
    xfer = prefill.start_send(
        "k", "req-k", decode.addr, src, all_saved=False, prompt_digest=DIGEST
    )
    nbytes = LAYERS * len(src) * PAGE
    wait_for(lambda: decode.occupancy() == (nbytes, 0), "the offer to reserve room")
    # The room is taken just before the slot is filed: wait for both, so that
    # abandon() meets a receiving slot (the other order has its own test).
    wait_for(
        lambda: decode.engine.receiver.table.state("k") is RecvState.RECEIVING,
        "the offer's slot",
    )
    if abandon:
        decode.abandon("k")  # while receiving: freed when the receive ends, not now
        with decode.engine._lock:
            if decode.engine.receiver.table.state("k") is RecvState.ABANDONING:
                assert decode.engine.receiver.room.buffer_used == nbytes

    assert not wait_done(xfer).ok
    assert "never saved" in xfer.reason
    assert time.monotonic() - start >= hold - 0.05
    assert prefill.totals()["failed_sends"] == 1

    if abandon:
        wait_for(lambda: decode.occupancy() == (0, 0), "the abandoned slot to be freed")
        assert decode.poll("k") is None
    else:
        slot = wait_slot(
            decode, "k"
        )  # failed by the broken channel, long before its deadline
        assert slot.state is SlotState.FAILED and "receive failed" in slot.reason
        assert time.monotonic() - start < 10.0
        assert decode.occupancy() == (nbytes, 0)
        decode.release(slot)
    assert_nothing_held(decode)
    assert decode.totals()["blocks_received"] == 0
    old_channel = prefill.engine._peers[decode.addr].channel_id
    assert prefill.engine._peers[decode.addr].channel is None

    # the next transfer sets up a new channel and succeeds
    xfer2 = send(prefill, decode, "k2", [4, 5], mode="PUT_ASYNC")
    receive(decode, "k2", [50, 51], 0)
    assert wait_done(xfer2).ok, xfer2.reason
    assert prefill.engine._peers[decode.addr].channel_id != old_channel
    assert_blocks_equal(decode, [50, 51], prefill, [4, 5])
    assert_nothing_held(decode)


def test_get_for_a_key_never_held_fails_at_the_deadline(make_engine):
    prefill = make_engine("fake", "GET", seed=1)
    decode = make_engine("fake", "GET", seed=2)
    start = time.monotonic()
    exp_deadline = start + 1.0
    decode.expect("k", 0, exp_deadline, get_from=prefill.addr, prompt_digest=DIGEST)
    time.sleep(0.3)
    if (
        time.monotonic() < exp_deadline - 0.2
    ):  # (a heavily loaded machine may oversleep)
        assert (
            decode.poll("k") is None
        )  # NOT_READY: the GET is retried until the deadline
    slot = wait_slot(decode, "k", timeout=5.0)
    assert slot.state is SlotState.FAILED
    # Asked until the deadline: the last Get's reply or the last retry ends it.
    assert (
        "no reply" in slot.reason or "in time" in slot.reason
    ) and prefill.addr in slot.reason
    assert time.monotonic() >= exp_deadline - limits.GET_RETRY_INTERVAL_S - 0.01
    decode.release(slot)
    assert_nothing_held(decode)
    assert prefill.take_finished_sends() == []
    assert prefill.totals()["rejected_messages"] == 0


def test_hold_expires_and_a_late_get_is_gone(make_engine):
    hold = 0.3
    prefill = make_engine("fake", "GET", hold=hold, seed=1)
    decode = make_engine("fake", "GET", seed=2)
    start = time.monotonic()
    xfer = prefill.hold("k", "req-k", [1, 2], prompt_digest=DIGEST)
    finished = wait_for(prefill.take_finished_sends, "the hold to expire", timeout=5.0)
    assert finished == [xfer] and xfer.done.is_set()
    assert not xfer.ok and "kv_hold_timeout_s" in xfer.reason
    assert time.monotonic() - start >= hold
    assert prefill.totals()["failed_sends"] == 1

    decode.expect("k", 0, deadline(30.0), get_from=prefill.addr, prompt_digest=DIGEST)
    slot = wait_slot(decode, "k", timeout=10.0)  # well before the decode's deadline
    assert slot.state is SlotState.FAILED and Status.GONE in slot.reason
    decode.release(slot)
    assert_nothing_held(decode)


def test_a_hold_is_pulled_once(make_engine):
    prefill = make_engine("fake", "GET", seed=1)
    decode = make_engine("fake", "GET", seed=2)
    xfer = send(prefill, decode, "k", [1, 2], mode="GET")
    receive(decode, "k", [3, 4], 0)
    assert wait_done(xfer).ok
    # the hold is gone after the pull: a second GET is retried until its deadline
    decode.expect("k", 0, deadline(0.3), get_from=prefill.addr, prompt_digest=DIGEST)
    slot = wait_slot(decode, "k", timeout=3.0)
    assert slot.state is SlotState.FAILED
    decode.release(slot)
    assert_nothing_held(decode)


# --- refused channels --------------------------------------------------------


@pytest.mark.parametrize(
    "decode_kw, field",
    [
        pytest.param(dict(shape=(1, 16, 128)), "page_bytes", id="page-size"),
        pytest.param(dict(layers=2), "num_layers", id="layer-count"),
        pytest.param(dict(block_size=16), "block_size", id="block-size"),
        pytest.param(
            dict(shape=(1, 32, 256), dtype=torch.bfloat16), "dtype", id="dtype"
        ),
    ],
)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layout_mismatch_refuses_the_hello(
    make_engine, transport, decode_kw, field, caplog
):
    prefill = make_engine(transport, "PUT", seed=1)
    decode = make_engine(transport, "PUT", seed=2, **decode_kw)
    with caplog.at_level(logging.WARNING):
        xfer = send(prefill, decode, "k", [1, 2], mode="PUT")
        assert not wait_done(xfer).ok
    # The peer learns only the kind of refusal; the layout stays in the decode's log.
    assert "refused the channel (layout;" in xfer.reason, xfer.reason
    assert "KV layout mismatch" not in xfer.reason and field not in xfer.reason
    assert any(
        "KV layout mismatch" in r.getMessage() and field in r.getMessage()
        for r in caplog.records
    )
    assert decode.totals()["rejected_messages"] == 1
    assert_nothing_allocated(decode)
    assert not decode.engine.receiver.inbound


def test_a_hello_cutting_layers_into_other_messages_is_refused(make_engine, caplog):
    # Both ends compute where a transfer's data messages end from
    # LAYER_MESSAGE_BYTES; a peer built with another value would fail every
    # slot on a length check (and believe its sends went well): refused at
    # the Hello instead, both values in the decode's log (review F2).
    prefill = make_engine("tcp", "PUT", seed=1)
    decode = make_engine("tcp", "PUT", seed=2)
    local = prefill.engine.local
    own_hello = local.hello
    other = proto.LAYER_MESSAGE_BYTES // 2
    local.hello = lambda *a: msgspec.structs.replace(own_hello(*a), message_bytes=other)
    with caplog.at_level(logging.WARNING):
        xfer = send(prefill, decode, "k", [1, 2], mode="PUT")
        assert not wait_done(xfer).ok
    assert "refused the channel (layout;" in xfer.reason, xfer.reason
    assert any(
        f"data messages of up to {other} bytes, this worker "
        f"{proto.LAYER_MESSAGE_BYTES}" in r.getMessage()
        for r in caplog.records
    )
    assert decode.totals()["rejected_messages"] == 1
    assert not decode.engine.receiver.inbound
    # A Hello of this version without the field is from a 2 MiB build.
    hello = own_hello(1, "c", b"")
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(hello))
    assert fields[-1] == proto.LAYER_MESSAGE_BYTES == 2 << 20
    old = msgspec.msgpack.decode(
        msgspec.msgpack.encode(fields[:-1]), type=proto.Message
    )
    assert old.message_bytes == 2 << 20


@pytest.mark.parametrize(
    "prefill_kw, decode_kw, words",
    [
        pytest.param(
            dict(send_type="PUT"),
            dict(send_type="PUT_ASYNC"),
            "send_type",
            id="send-type",
        ),
        pytest.param(
            dict(transport="fake"), dict(transport="tcp"), "transport", id="transport"
        ),
    ],
)
def test_mismatched_peers_are_refused(make_engine, prefill_kw, decode_kw, words):
    prefill = make_engine(**{"transport": "fake", "send_type": "PUT", **prefill_kw})
    decode = make_engine(**{"transport": "fake", "send_type": "PUT", **decode_kw})
    xfer = send(prefill, decode, "k", [1, 2], mode="PUT")
    assert not wait_done(xfer).ok
    assert "refused the channel" in xfer.reason and words in xfer.reason, xfer.reason
    assert decode.totals()["rejected_messages"] == 1
    assert_nothing_allocated(decode)


# --- concurrency -------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_concurrent_transfers_land_in_the_right_blocks(make_engine, transport):
    senders = [make_engine(transport, "PUT_ASYNC", seed=10 + i) for i in range(2)]
    decode = make_engine(transport, "PUT_ASYNC", seed=2)
    rng = random.Random(1234)
    plan = []  # (sender, key, src ids, skip, dst ids)
    free_dst = list(range(BLOCKS))
    rng.shuffle(free_dst)
    for s, sender in enumerate(senders):
        src_pool = list(range(BLOCKS))
        rng.shuffle(src_pool)
        for j in range(10):
            n, skip = 2 + j % 3, j % 2
            src = [src_pool.pop() for _ in range(n)]
            dst = [free_dst.pop() for _ in range(n - skip)]
            plan.append((sender, f"s{s}-req{j}", src, skip, dst))
    for _, key, _, skip, _ in plan:
        decode.expect(key, skip, deadline(), get_from=None, prompt_digest=DIGEST)
    xfers = [
        sender.start_send(
            key, key, decode.addr, src, all_saved=False, prompt_digest=DIGEST
        )
        for sender, key, src, _, _ in plan
    ]
    for layer in range(LAYERS):  # interleaved layer saves, as two forward passes would
        order = list(xfers)
        rng.shuffle(order)
        for i, xfer in enumerate(order):
            xfer.layer_saved(layer, None)
            if i % 7 == 0:
                time.sleep(0.001)
    for _sender, key, _src, skip, dst in plan:
        receive(decode, key, dst, skip)
    for sender, key, src, skip, dst in plan:
        assert_blocks_equal(decode, dst, sender, src[skip:])
    assert all(wait_done(x).ok for x in xfers), [x.reason for x in xfers if not x.ok]
    assert_nothing_held(decode)
    expected_blocks = sum(len(dst) for *_, dst in plan)
    got = decode.totals()
    assert got["blocks_received"] == expected_blocks
    assert got["bytes_received"] == expected_blocks * LAYERS * PAGE
    assert sum(s.totals()["blocks_sent"] for s in senders) == expected_blocks


# --- hostile peers -----------------------------------------------------------


def _flood_frames(n: int, secret: bytes | None) -> list[list[bytes]]:
    """``n`` frames the listener must each reject exactly once (count them)."""
    layout = LayoutSpec(
        num_layers=LAYERS, page_bytes=PAGE, block_size=BLOCK_SIZE, dtype="float32"
    )
    foreign = b"not the secret"
    kinds = [
        lambda i: [b"\xc1garbage %d" % i],  # one frame
        lambda i: [b"a", b"b", b"c %d" % i],  # three frames
        lambda i: [b"\x00" * (proto.MAX_FRAME_BYTES + 1 + i % 7), b""],  # oversized
        lambda i: [msgspec.msgpack.encode(["nope", i]), b""],  # unknown tag
        lambda i: [b"\x92\xa5offer", b""],  # truncated
        # a well-formed message under another secret (or none)
        lambda i: proto.seal(
            foreign,
            Offer(
                req_no=i,
                channel_id="feed",
                key=f"k{i}",
                prompt_digest=DIGEST,
                xfer_id=0,
                num_blocks=2,
            ),
        ),
        lambda i: proto.seal(None, Reply(req_no=i, status=Status.OK)),
        lambda i: proto.seal(
            foreign,
            Hello(
                version=-1,
                req_no=i,
                sender_addr="127.0.0.1:1",
                channel_id=f"c{i}",
                transport="fake",
                setup=b"",
                layout=layout,
                send_type="PUT_ASYNC",
                sent_at=time.time(),
            ),
        ),
    ]
    if secret is not None:
        # out-of-bounds and garbage content with a valid MAC: "malformed"
        def garbage_with_mac(i):
            payload = msgspec.msgpack.encode(["offer", i, "c", "", 0, 1, ""])
            return [payload, proto._codec.mac(secret, payload)]

        kinds.append(garbage_with_mac)
    return [kinds[i % len(kinds)](i) for i in range(n)]


@pytest.mark.parametrize("secret", [None, b"s3cret"], ids=["no-secret", "secret"])
def test_a_flood_of_bad_frames_does_not_disturb_a_transfer(make_engine, secret):
    n_frames = 2000
    prefill = make_engine("fake", "PUT_ASYNC", secret=secret, seed=1)
    decode = make_engine("fake", "PUT_ASYNC", secret=secret, seed=2)
    frames = _flood_frames(n_frames, secret)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDTIMEO, 5000)  # a blocked send fails instead of hanging
    dealer.connect(zmq_endpoint(decode.addr))
    flood_error: list[BaseException] = []

    def flood():
        try:
            for i, msg in enumerate(frames):
                dealer.send_multipart(msg)
                if i % 100 == 0:
                    time.sleep(0.001)  # spread the flood over the transfers
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            flood_error.append(e)

    try:
        with WarningCounter() as warnings:
            thread = threading.Thread(target=flood, daemon=True)
            thread.start()
            xfers = []
            for k in range(4):
                src = [k * 3 + 1, k * 3 + 2, k * 3 + 3]
                xfers.append(send(prefill, decode, f"k{k}", src, mode="PUT_ASYNC"))
                receive(decode, f"k{k}", [40 + k * 3, 41 + k * 3, 42 + k * 3], 0)
                assert_blocks_equal(
                    decode, [40 + k * 3, 41 + k * 3, 42 + k * 3], prefill, src
                )
            thread.join(WAIT_S)
            assert not thread.is_alive() and not flood_error, flood_error
            wait_for(
                lambda: decode.totals()["rejected_messages"] >= n_frames,
                "the listener to reject every frame",
            )
            time.sleep(0.1)
        assert all(wait_done(x).ok for x in xfers), [x.reason for x in xfers]
        got = decode.totals()
        assert got["rejected_messages"] == n_frames
        assert got["blocks_received"] == 12
        assert prefill.totals()["rejected_messages"] == 0
        assert_nothing_held(decode)
        # rejections are logged at most once per kind per interval
        lines = [r.getMessage() for r in warnings.records]
        assert len(lines) <= 8, lines
        assert all("rejected a message" in line for line in lines), lines
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_raw_tcp_garbage_at_the_listener_is_harmless(make_engine):
    prefill = make_engine("fake", "PUT", seed=1)
    decode = make_engine("fake", "PUT", seed=2)
    host, port = decode.addr.rsplit(":", 1)
    for junk in [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        bytes(range(256)) * 4,
        b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00NULL" + b"\x00" * 60,
        b"",
    ]:
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(junk)
    xfer = send(prefill, decode, "k", [1, 2], mode="PUT")
    receive(decode, "k", [3, 4], 0)
    assert wait_done(xfer).ok, xfer.reason
    assert_blocks_equal(decode, [3, 4], prefill, [1, 2])
    assert_nothing_held(decode)


def test_engines_sharing_a_secret_transfer(make_engine):
    secret = b"shared"
    prefill = make_engine("tcp", "GET", secret=secret, seed=1)
    decode = make_engine("tcp", "GET", secret=secret, seed=2)
    xfer = send(prefill, decode, "k", [1, 2, 3], mode="GET", skip=1)
    receive(decode, "k", [7, 8], 1)
    assert_blocks_equal(decode, [7, 8], prefill, [2, 3])
    assert wait_done(xfer).ok
    assert (
        decode.totals()["rejected_messages"]
        == prefill.totals()["rejected_messages"]
        == 0
    )


@pytest.mark.parametrize(
    "intruder_secret", [b"another", None], ids=["other-secret", "no-secret"]
)
def test_an_engine_with_another_secret_is_refused(make_engine, intruder_secret):
    decode = make_engine("fake", "PUT", secret=b"right", seed=2)
    intruder = make_engine("fake", "PUT", secret=intruder_secret, hold=0.5, seed=1)
    decode.expect("k", 0, deadline(), get_from=None, prompt_digest=DIGEST)
    xfer = intruder.start_send(
        "k", "req-k", decode.addr, [1, 2, 3], all_saved=True, prompt_digest=DIGEST
    )
    assert not wait_done(xfer).ok
    assert "no reply" in xfer.reason
    assert decode.totals()["rejected_messages"] == 1  # the Hello, unauthenticated
    assert decode.occupancy() == (0, 0)
    assert not decode.engine.receiver.inbound and open_keys(decode) == {
        "k": RecvState.EXPECTED
    }
    assert decode.poll("k") is None
    decode.abandon("k")
    assert_nothing_held(decode)


# --- injected transport failures ---------------------------------------------


def test_a_failed_send_breaks_the_channel_and_the_next_transfer_recovers(make_engine):
    prefill = make_engine("fake", "PUT", seed=1)
    decode = make_engine("fake", "PUT", seed=2)
    x1 = send(prefill, decode, "a", [1, 2], mode="PUT")
    receive(decode, "a", [10, 11], 0)
    assert wait_done(x1).ok
    peer = prefill.engine._peers[decode.addr]
    first_channel = peer.channel_id
    peer.channel.fail_next_send = True

    x2 = send(prefill, decode, "b", [3, 4], mode="PUT")
    assert not wait_done(x2).ok and "injected send failure" in x2.reason
    slot = wait_slot(decode, "b")
    assert slot.state is SlotState.FAILED and "injected send failure" in slot.reason
    decode.release(slot)
    assert_nothing_held(decode)

    x3 = send(prefill, decode, "c", [5, 6], mode="PUT")
    receive(decode, "c", [12, 13], 0)
    assert wait_done(x3).ok, x3.reason
    assert peer.channel_id != first_channel
    assert_blocks_equal(decode, [10, 11, 12, 13], prefill, [1, 2, 5, 6])
    assert_nothing_held(decode)


def test_an_outage_mid_transfer_fails_it_and_the_next_transfer_recovers(make_engine):
    prefill = make_engine("fake", "PUT_ASYNC", seed=1)
    decode = make_engine("fake", "PUT_ASYNC", seed=2)
    decode.expect("a", 0, deadline(), get_from=None, prompt_digest=DIGEST)
    x1 = prefill.start_send(
        "a", "req-a", decode.addr, [1, 2, 3], all_saved=False, prompt_digest=DIGEST
    )
    x1.layer_saved(0, None)
    wait_for(lambda: decode.occupancy()[0] > 0, "the offer to reserve room")
    FakeTransport.break_all("injected outage")
    x1.layer_saved(1, None)
    x1.layer_saved(2, None)
    assert not wait_done(x1).ok and "outage" in x1.reason
    slot = wait_slot(decode, "a")
    assert slot.state is SlotState.FAILED and "outage" in slot.reason
    decode.release(slot)
    assert_nothing_held(decode)

    x2 = send(prefill, decode, "b", [4, 5], mode="PUT_ASYNC")
    receive(decode, "b", [20, 21], 0)
    assert wait_done(x2).ok, x2.reason
    assert_blocks_equal(decode, [20, 21], prefill, [4, 5])
    assert_nothing_held(decode)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_receive_that_fails_after_the_sender_finished_does_not_wedge_the_peer(
    make_engine, transport, monkeypatch
):
    # The receiver's end breaks after the sender has written every byte (its
    # receive deadline passed while the bytes sat in socket buffers, say): the
    # sender's channel looks fine, but the receiver dropped its end. The next
    # transfers must not be refused forever as offers on an unknown channel.
    prefill = make_engine(transport, "PUT", seed=1)
    decode = make_engine(transport, "PUT", seed=2)
    x1 = send(prefill, decode, "a", [1, 2], mode="PUT")
    receive(decode, "a", [10, 11], 0)
    assert wait_done(x1).ok

    real_recv_layers = InboundChannel._recv_layers
    x2_holder: list[SendTransfer] = []

    def recv_after_the_sender_is_done(inbound, slot, layers):
        if slot.key == "b":
            wait_for(lambda: x2_holder and x2_holder[0].done.is_set(), "the send of b")
            raise TransportError("injected: receive deadline passed")
        real_recv_layers(inbound, slot, layers)

    monkeypatch.setattr(InboundChannel, "_recv_layers", recv_after_the_sender_is_done)
    x2_holder.append(send(prefill, decode, "b", [3, 4], mode="PUT"))
    assert wait_done(x2_holder[0]).ok  # as far as the sender can tell
    slot = wait_slot(decode, "b")
    assert slot.state is SlotState.FAILED
    decode.release(slot)
    wait_for(
        lambda: not decode.engine.receiver.inbound,
        "the receiver to drop its channel end",
    )

    stale_channel = prefill.engine._peers[decode.addr].channel_id
    for key, dst in [("c", [12, 13]), ("d", [14, 15])]:
        xfer = send(prefill, decode, key, [5, 6], mode="PUT")
        assert wait_done(xfer).ok, xfer.reason
        slot = wait_slot(decode, key)
        assert slot.state is SlotState.COMPLETE, slot.reason
        decode.copy_into_cache(slot, dst, 0)
        decode.release(slot)
        assert_blocks_equal(decode, dst, prefill, [5, 6])
    assert prefill.engine._peers[decode.addr].channel_id != stale_channel
    # the stale offer was refused once, and retried on a new channel
    assert decode.totals()["rejected_messages"] == 1
    assert prefill.totals()["failed_sends"] == 0
    assert_nothing_held(decode)


def test_a_get_accepted_without_an_offer_is_asked_again_until_settled(make_engine):
    """Decode keeps asking (on the same connection) while an accepted Get has
    brought no offer; "gone" (the prefill's send ended without one) fails the
    load at once. No blind resend: the first Get is answered, not lost."""
    decode = make_engine("fake", "GET", seed=2)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        start = time.monotonic()
        decode.expect(
            "k", 0, start + 20.0, get_from=f"127.0.0.1:{port}", prompt_digest=DIGEST
        )
        gets = []
        for status in (Status.OK, Status.GONE):
            assert router.poll(5000), f"no Get arrived after {len(gets)}"
            route, *body = router.recv_multipart()
            msg = proto.open_frame(None, body)
            assert msg.key == "k"
            gets.append((route, time.monotonic()))
            router.send_multipart(
                [route, *proto.seal(None, Reply(req_no=msg.req_no, status=status))]
            )
        (first_route, first_at), (route, second_at) = gets
        assert route == first_route  # the same socket: nothing was lost
        assert second_at - first_at >= limits.GET_CONFIRM_INTERVAL_S - 0.05
        slot = wait_slot(decode, "k", timeout=5.0)
        assert slot.state is SlotState.FAILED and Status.GONE in slot.reason
        assert time.monotonic() - start < 10.0
        decode.release(slot)
    finally:
        router.close(linger=0)
        ctx.term()


# --- CUDA stream ordering ------------------------------------------------------


def test_a_copy_within_one_device_needs_no_wait():
    kv = {f"l{i}": torch.zeros(4, *BLOCK_SHAPE) for i in range(2)}
    layout = KVLayout(kv, BLOCK_SIZE)
    assert layout.write_blocks(0, [1], torch.ones(PAGE, dtype=torch.uint8)) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pool_block_is_read_before_copy_into_cache_returns():
    """The host pool block is freed, and may be refilled by the next receive,
    as soon as copy_into_cache returns; the asynchronous host-to-device copies
    must have read it by then."""
    blocks, shape = 256, (2, 16, 8, 64)  # 64 KiB pages, 25 MiB in all
    kv = {f"l{i}": torch.zeros(blocks, *shape, device="cuda") for i in range(2)}
    layout = KVLayout(kv, BLOCK_SIZE)
    n = 200
    src = torch.empty(2 * n * layout.page_bytes, dtype=torch.uint8).pin_memory()
    src.view(torch.float32).copy_(torch.arange(src.numel() // 4, dtype=torch.float32))
    expected = src.clone()
    slot = RecvSlot(
        key="k",
        num_blocks=n,
        skip_blocks=0,
        page_bytes=layout.page_bytes,
        num_layers=2,
        tensor=src,
        pool_alloc=None,
        deadline=time.monotonic() + 60,
    )
    engine = P2pEngine.__new__(P2pEngine)  # only copy_into_cache's layout is used
    engine.layout = layout
    torch.accelerator.synchronize()
    torch.cuda._sleep(50_000_000)  # keep the stream busy so the copies queue behind it
    P2pEngine.copy_into_cache(engine, slot, list(range(n)), 0)
    src.fill_(0)  # the next receive into the freed pool block
    torch.accelerator.synchronize()
    for i, t in enumerate(layout.tensors):
        got = t[:n].reshape(-1).view(torch.uint8).cpu()
        want = expected[i * n * layout.page_bytes : (i + 1) * n * layout.page_bytes]
        assert torch.equal(got, want), f"layer {i} read the refilled pool block"
