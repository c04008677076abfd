"""``kv_checksum``: per-block checksums of every transfer, two real engines in
one process (the ``make_engine`` fixture, conftest.py).

Byte-equal transfers with a checksum in every send mode and transport; a block
corrupted after the receive (a transport wrapper flips one byte of what came
in) fails the load at once, is counted and logged, frees its room, and the
next transfer on the same channel lands; both ends must name one algorithm;
the option refuses what it cannot run.
"""

from __future__ import annotations

import logging
import sys

import msgspec
import pytest
import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    ALGORITHMS,
    DIGEST_BYTES,
    ChecksumUnavailable,
    make_checksum,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import P2pConfig
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
    KVLayout,
    P2pEngine,
    SlotState,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import COUNTERS
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.fake import (
    FakeChannel,
    FakeTransport,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.tcp import (
    TcpChannel,
)
from vllm_disagg.errors import ConfigError

from .test_engine import (
    DIGEST,
    HOST,
    LAYERS,
    PAGE,
    WarningCounter,
    assert_blocks_equal,
    assert_nothing_held,
    deadline,
    receive,
    send,
    wait_done,
    wait_slot,
)

ALGORITHM = "crc32c"  # the one the project installs (requirements/common.txt)
CHANNELS = {"fake": FakeChannel, "tcp": TcpChannel}


def installed() -> list[str]:
    found = []
    for name in ALGORITHMS:
        try:
            make_checksum(name)
        except ChecksumUnavailable:
            continue
        found.append(name)
    return found


# --- the algorithms ----------------------------------------------------------


@pytest.mark.parametrize("name", installed())
def test_block_views_and_one_tensor_give_the_same_digests(name):
    # The sender hashes block views of its cache, the receiver one tensor.
    checksum = make_checksum(name)
    cache = torch.randn(16, PAGE // 4)
    ids = [3, 9, 4, 15]
    views = [cache[b].view(torch.uint8) for b in ids]
    sent = checksum.digests(views, PAGE)
    assert sent.dtype == torch.uint8 and sent.numel() == len(ids) * DIGEST_BYTES
    received = torch.cat(views).clone()
    assert checksum.mismatches(received, PAGE, sent) == []
    # a gathered message (a cache whose blocks are not contiguous) hashes alike
    assert torch.equal(checksum.digests([received], PAGE), sent)
    received[2 * PAGE + 100] ^= 1
    received[3 * PAGE] ^= 0x80
    assert checksum.mismatches(received, PAGE, sent) == [2, 3]


def test_the_project_installs_its_algorithm():
    assert ALGORITHM in installed()


def test_a_missing_library_or_an_unknown_name_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "crc32c", None)  # import fails
    with pytest.raises(ChecksumUnavailable, match=r"pip install crc32c"):
        make_checksum("crc32c")
    with pytest.raises(ChecksumUnavailable, match="allowed values: none, "):
        make_checksum("md5")
    assert make_checksum("none") is None


def test_an_engine_without_host_memory_transfers_refuses_a_checksum():
    class DeviceOnly(FakeTransport):
        receives_into_host = False  # as nccl

    kv = {"layer.0": torch.zeros(4, PAGE // 4)}
    with pytest.raises(ChecksumUnavailable, match="set kv_checksum to none"):
        P2pEngine(
            layout=KVLayout(kv, 16),
            host=HOST,
            port=1,  # refused before anything listens
            transport=DeviceOnly(torch.device("cpu"), HOST),
            send_type="PUT",
            kv_buffer_size=1 << 20,
            mem_pool_size_bytes=0,
            hold_timeout_s=1.0,
            checksum=ALGORITHM,
        )


# --- transfers ---------------------------------------------------------------


@pytest.mark.parametrize("skip", [0, 2])
@pytest.mark.parametrize("mode", ["PUT_ASYNC", "PUT", "GET"])
@pytest.mark.parametrize("transport", ["fake", "tcp"])
def test_transfers_with_a_checksum_land_byte_equal(make_engine, transport, mode, skip):
    prefill = make_engine(transport, mode, seed=1, checksum=ALGORITHM)
    decode = make_engine(transport, mode, seed=2, checksum=ALGORITHM)
    src = [5, 7, 9, 11, 13]
    dst = [40, 41, 42, 43, 44][skip:]
    for round_ in range(2):  # the second on the same channel
        key = f"k{round_}"
        xfer = send(prefill, decode, key, src, mode=mode, skip=skip)
        receive(decode, key, dst, skip)
        assert wait_done(xfer).ok, xfer.reason
        assert_blocks_equal(decode, dst, prefill, src[skip:])
    held = len(src) - skip
    got, sent = decode.totals(), prefill.totals()
    # the digests are not KV: bytes count the blocks only
    assert got["bytes_received"] == sent["bytes_sent"] == 2 * LAYERS * held * PAGE
    assert got["checksum_mismatches"] == got["rejected_messages"] == 0
    assert_nothing_held(decode)


def test_gloo_carries_the_digests_too(make_engine):
    prefill = make_engine("gloo", "PUT", seed=1, checksum=ALGORITHM)
    decode = make_engine("gloo", "PUT", seed=2, checksum=ALGORITHM)
    xfer = send(prefill, decode, "k", [1, 3, 5], mode="PUT")
    receive(decode, "k", [20, 21, 22], 0)
    assert wait_done(xfer).ok, xfer.reason
    assert_blocks_equal(decode, [20, 21, 22], prefill, [1, 3, 5])
    assert decode.totals()["checksum_mismatches"] == 0


class Corruptor:
    """Wraps a channel class's recv: after the real receive, flips one byte of
    block 1 of the next ``armed`` layer messages received, in their KV
    (``part`` 0) or in the digests appended to them (``part`` 1). Only
    messages the receiver checks (KV and digests, two tensors): the drain of
    an already discarded transfer (one scratch tensor) may still be running
    when the next test step arms it, and must not take the arming."""

    def __init__(self, monkeypatch, channel_cls, *, part: int):
        self.armed = 0
        self.parts = 2  # one layer's pages and digests: a message of the transfer
        offset = PAGE + 7 if part == 0 else DIGEST_BYTES + 3
        real = channel_cls.recv
        corruptor = self

        def recv(channel, tensors, deadline):
            real(channel, tensors, deadline)
            if corruptor.armed and len(tensors) == corruptor.parts:
                corruptor.armed -= 1
                tensors[part][offset] ^= 0x20

        monkeypatch.setattr(channel_cls, "recv", recv)


@pytest.mark.parametrize("per_message", [1, 2], ids=["1-layer", "2-layer"])
@pytest.mark.parametrize("part", [0, 1], ids=["kv", "digests"])
@pytest.mark.parametrize("transport", ["fake", "tcp"])
def test_a_corrupted_block_fails_the_load_at_once_and_the_channel_goes_on(
    make_engine, monkeypatch, transport, part, per_message
):
    # Messages of ``per_message`` layers of the 3-block transfer "bad"
    # (protocol.layer_groups): its first is corrupted, the rest drained.
    monkeypatch.setattr(proto, "LAYER_MESSAGE_BYTES", per_message * 3 * PAGE)
    prefill = make_engine(transport, "PUT_ASYNC", seed=1, checksum=ALGORITHM)
    decode = make_engine(transport, "PUT_ASYNC", seed=2, checksum=ALGORITHM)
    corruptor = Corruptor(monkeypatch, CHANNELS[transport], part=part)
    corruptor.parts = 2 * per_message

    x0 = send(prefill, decode, "a", [1, 2, 3], mode="PUT")  # channel up, checked
    receive(decode, "a", [30, 31, 32], 0)
    assert wait_done(x0).ok
    channel_id = prefill.engine._peers[decode.addr].channel_id

    with WarningCounter() as warnings:
        decode.expect("bad", 0, deadline(), get_from=None, prompt_digest=DIGEST)
        xfer = prefill.start_send(
            "bad",
            "req-bad",
            decode.addr,
            [4, 5, 6],
            all_saved=False,
            prompt_digest=DIGEST,
        )
        corruptor.armed = 1
        for layer in range(per_message):  # only the first message's layers exist
            xfer.layer_saved(layer, None)
        slot = wait_slot(decode, "bad")
        # failed on its first message: the sender has not even saved the others
        assert slot.state is SlotState.FAILED
        assert "checksum mismatch (crc32c): layer 0, block 1 " in slot.reason
        assert not xfer.done.is_set()
        decode.release(slot)
        for layer in range(per_message, LAYERS):
            xfer.layer_saved(layer, None)
        assert wait_done(xfer).ok  # as far as the sender can tell

    got = decode.totals()
    assert got["checksum_mismatches"] == 1
    assert got["blocks_received"] == 3  # transfer "a" only
    lines = [r.getMessage() for r in warnings.records]
    assert any("discarded the KV of bad" in line for line in lines), lines
    # its room is free; nothing of it is held
    assert decode.occupancy() == (0, 0)

    # the next transfer on the same channel lands, checked
    x2 = send(prefill, decode, "c", [7, 8], mode="PUT")
    receive(decode, "c", [33, 34], 0)
    assert wait_done(x2).ok, x2.reason
    assert prefill.engine._peers[decode.addr].channel_id == channel_id
    assert_blocks_equal(decode, [30, 31, 32, 33, 34], prefill, [1, 2, 3, 7, 8])
    assert decode.totals()["checksum_mismatches"] == 1
    assert_nothing_held(decode)


def test_mismatches_are_logged_rate_limited(make_engine, monkeypatch):
    prefill = make_engine("fake", "PUT", seed=1, checksum=ALGORITHM)
    decode = make_engine("fake", "PUT", seed=2, checksum=ALGORITHM)
    corruptor = Corruptor(monkeypatch, FakeChannel, part=0)
    corruptor.parts = 2 * LAYERS  # one message carries the whole small transfer
    with WarningCounter() as warnings:
        for k in range(4):
            corruptor.armed = 1
            xfer = send(prefill, decode, f"k{k}", [1, 2], mode="PUT")
            slot = wait_slot(decode, f"k{k}")
            assert slot.state is SlotState.FAILED, slot.reason
            decode.release(slot)
            assert wait_done(xfer).ok
    assert decode.totals()["checksum_mismatches"] == 4
    lines = [r.getMessage() for r in warnings.records if "checksum" in r.getMessage()]
    assert len(lines) == 1, lines


# --- both ends agree ---------------------------------------------------------


@pytest.mark.parametrize(
    "sender, receiver",
    [("crc32", ALGORITHM), ("none", ALGORITHM), (ALGORITHM, "none")],
    ids=["other-algorithm", "sender-none", "receiver-none"],
)
def test_a_hello_with_another_algorithm_is_refused(
    make_engine, sender, receiver, caplog
):
    prefill = make_engine("fake", "PUT", seed=1, checksum=sender)
    decode = make_engine("fake", "PUT", seed=2, checksum=receiver)
    with caplog.at_level(logging.WARNING):
        xfer = send(prefill, decode, "k", [1, 2], mode="PUT")
        assert not wait_done(xfer).ok
    # the sender learns the kind of refusal only; the decode's log says more
    assert "refused the channel (checksum;" in xfer.reason, xfer.reason
    assert receiver not in xfer.reason.split("(checksum;")[1]
    assert any(
        f"attaches kv_checksum {sender}, this worker checks {receiver}"
        in r.getMessage()
        for r in caplog.records
    )
    assert decode.totals()["rejected_messages"] == 1
    assert not decode.engine.receiver.inbound
    decode.abandon("k")
    assert_nothing_held(decode)


def test_a_hello_without_the_field_attaches_no_checksum():
    # A protocol-3 sender from before the field: its Hello decodes as "none".
    hello = proto.Hello(
        version=proto.PROTOCOL_VERSION,
        req_no=1,
        sender_addr="127.0.0.1:1",
        channel_id="c",
        transport="tcp",
        setup=b"",
        layout=proto.LayoutSpec(1, 1, 1, "float32"),
        send_type="PUT",
        sent_at=0.0,
        model=b"m",
    )
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(hello))
    assert fields[-2:] == ["none", proto.LAYER_MESSAGE_BYTES]  # checksum, then
    old = msgspec.msgpack.encode(fields[:-2])
    decoded = msgspec.msgpack.decode(old, type=proto.Message)
    assert decoded.checksum == "none" and decoded.model == b"m"
    too_long = proto.seal(None, msgspec.structs.replace(hello, checksum="x" * 17))
    with pytest.raises(proto.FrameError, match="checksum name too long"):
        proto.open_frame(None, too_long)


def test_the_mismatch_counter_is_a_metric():
    assert "checksum_mismatches" in COUNTERS  # -> vllm:p2p_checksum_mismatches


# --- the option --------------------------------------------------------------


def test_the_option_is_off_by_default_and_offers_what_is_installed():
    assert P2pConfig(role="kv_consumer", base_port=21001).kv_checksum == "none"
    config = P2pConfig(role="kv_consumer", base_port=21001, kv_checksum=" CRC32C ")
    assert config.kv_checksum == ALGORITHM
    assert P2pConfig(role="kv_consumer", base_port=21001, kv_checksum="crc32")
    for measured_only in ("xxh3_64", "blake3", "md5", 1):
        with pytest.raises(ConfigError, match="kv_checksum: .* is not one of none"):
            P2pConfig(role="kv_consumer", base_port=21001, kv_checksum=measured_only)


def test_the_option_names_a_missing_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "crc32c", None)
    with pytest.raises(ConfigError, match=r"^kv_checksum: .*pip install crc32c"):
        P2pConfig(role="kv_consumer", base_port=21001, kv_checksum="crc32c")


def test_a_checksum_with_nccl_is_refused_at_start():
    with pytest.raises(ConfigError, match="kv_checksum, transport: .* nccl"):
        P2pConfig(
            role="kv_producer", base_port=21001, kv_checksum="crc32c", transport="nccl"
        )
    assert P2pConfig(role="kv_producer", base_port=21001, transport="nccl")
