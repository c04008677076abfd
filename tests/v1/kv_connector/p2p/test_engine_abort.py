"""A sender that gives up tells the receiver (``Abort``), which recomputes at
once instead of waiting out ``kv_load_timeout_s`` (issue 27).

Before, a decode whose prefill's Hello or Offer went unanswered, or whose
channel was refused, waited for KV that was never coming until its own
deadline: 30 s per request with the defaults.
"""

from __future__ import annotations

import time

import pytest
import zmq

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
    SlotState,
    limits,
    zmq_endpoint,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.recv_state import RecvState

from .test_engine import DIGEST, WAIT_S, wait_done

# The decode's own deadline in these tests: far beyond what any of them may wait.
LOAD_TIMEOUT_S = 60.0
# How soon the decode must learn of a failed send (loopback, an idle engine).
PROMPT_S = 5.0


def _refusing_hello(monkeypatch):
    """Every Hello is refused as stale (a skewed clock, issue 28's edge)."""
    monkeypatch.setattr(limits, "MAX_HELLO_AGE_S", -1.0)


def _wait_failed(decode, key: str, timeout: float):
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        slot = decode.poll(key)
        if slot is not None:
            return slot, time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"the decode still waits for {key} after {timeout}s")


def _start(prefill, decode, key: str):
    return prefill.start_send(
        key, f"req-{key}", decode.addr, [1, 2, 3], all_saved=True, prompt_digest=DIGEST
    )


@pytest.mark.parametrize("early", [False, True], ids=["expected", "before-expect"])
def test_a_refused_send_fails_the_load_at_once(make_engine, monkeypatch, early):
    prefill = make_engine("tcp", "PUT")
    decode = make_engine("tcp", "PUT")
    _refusing_hello(monkeypatch)
    if not early:
        decode.expect(
            "k",
            0,
            time.monotonic() + LOAD_TIMEOUT_S,
            get_from=None,
            prompt_digest=DIGEST,
            prefill_addr=prefill.addr,
        )
    xfer = wait_done(_start(prefill, decode, "k"))
    assert not xfer.ok and "stale" in xfer.reason, xfer.reason
    if early:
        # The abort came before the decode knew the request (PUT_ASYNC: the
        # prefill can finish first): remembered and applied at expect().
        deadline = time.monotonic() + WAIT_S
        while "k" not in decode.engine.receiver.early_aborts:
            assert time.monotonic() < deadline, "the abort never arrived"
            time.sleep(0.01)
        decode.expect(
            "k",
            0,
            time.monotonic() + LOAD_TIMEOUT_S,
            get_from=None,
            prompt_digest=DIGEST,
            prefill_addr=prefill.addr,
        )
    slot, waited = _wait_failed(decode, "k", PROMPT_S)
    assert slot.state is SlotState.FAILED
    assert "the prefill gave up sending it" in slot.reason, slot.reason
    assert waited < PROMPT_S


def test_an_unanswered_hello_fails_the_load_once_the_receiver_answers(
    make_engine, monkeypatch
):
    """The slow moment of issue 27: the decode answers nothing for a while;
    the prefill gives up, and the decode learns it as soon as it answers
    again, not at its deadline."""
    monkeypatch.setattr(limits, "CONTROL_REPLY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(limits, "PEER_RETRY_AFTER_S", 0.3)
    prefill = make_engine("tcp", "PUT")
    decode = make_engine("tcp", "PUT")
    decode.expect(
        "k",
        0,
        time.monotonic() + LOAD_TIMEOUT_S,
        get_from=None,
        prompt_digest=DIGEST,
        prefill_addr=prefill.addr,
    )
    handle = decode.engine._handle
    stalled_until = time.monotonic() + 1.5

    def slow_handle(msg, route=b"", source=None):
        if time.monotonic() < stalled_until:
            # The stall drops what arrives, so nothing reaches the handlers.
            return None
        return handle(msg, route, source)

    monkeypatch.setattr(decode.engine, "_handle", slow_handle)
    xfer = wait_done(_start(prefill, decode, "k"))
    assert not xfer.ok and "no reply to Hello" in xfer.reason, xfer.reason
    slot, _ = _wait_failed(decode, "k", PROMPT_S)
    assert "the prefill gave up sending it" in slot.reason


def test_an_abort_from_another_host_changes_nothing(make_engine, monkeypatch):
    prefill = make_engine("tcp", "PUT")
    decode = make_engine("tcp", "PUT")
    _refusing_hello(monkeypatch)
    # The request named a prefill on another (loopback) address.
    decode.expect(
        "k",
        0,
        time.monotonic() + LOAD_TIMEOUT_S,
        get_from=None,
        prompt_digest=DIGEST,
        prefill_addr="127.0.0.2:1",
    )
    wait_done(_start(prefill, decode, "k"))
    time.sleep(1.0)  # the abort (from 127.0.0.1) has long arrived
    assert decode.poll("k") is None
    with decode.engine._lock:
        assert decode.engine.receiver.table.state("k") is RecvState.EXPECTED


def test_aborts_of_unknown_keys_are_bounded(make_engine, monkeypatch):
    monkeypatch.setattr(limits, "MAX_EARLY_ABORTS", 10)
    decode = make_engine("tcp", "PUT")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(zmq_endpoint(decode.addr))
    try:
        for i in range(5):
            keys = [f"k{i}-{j}" for j in range(proto.MAX_ABORT_KEYS)]
            sock.send_multipart(proto.seal(None, proto.Abort(req_no=i, keys=keys)))
            assert sock.poll(int(WAIT_S * 1000)), "no answer to an Abort"
            reply = proto.open_frame(None, sock.recv_multipart())
            assert reply.status == proto.Status.OK
        assert len(decode.engine.receiver.early_aborts) == 10
        too_many = [f"x{j}" for j in range(proto.MAX_ABORT_KEYS + 1)]
        with pytest.raises(proto.FrameError):
            proto.open_frame(
                None, proto.seal(None, proto.Abort(req_no=9, keys=too_many))
            )
    finally:
        sock.close()
        ctx.term()


def test_a_slow_moment_costs_one_load_and_the_next_transfer_runs_at_once(
    make_engine, monkeypatch
):
    """Issue 27's pair: the decode's listener stalls (its messages queue up,
    nothing is lost), the prefill gives up on its Hello, and everything the
    decode handles late (the Hello, then the Abort) must be harmless: the
    load fails as soon as the decode answers again, nothing stays allocated,
    and the next transfer is served at normal speed on a new channel."""
    monkeypatch.setattr(limits, "CONTROL_REPLY_TIMEOUT_S", 0.5)
    monkeypatch.setattr(limits, "PEER_RETRY_AFTER_S", 0.3)
    monkeypatch.setattr(limits, "CHANNEL_SETUP_TIMEOUT_S", 1.0)
    prefill = make_engine("tcp", "PUT")
    decode = make_engine("tcp", "PUT")
    handle = decode.engine._handle
    stall = {"until": time.monotonic() + 1.5}

    def slow_handle(msg, route=b"", source=None):
        left = stall["until"] - time.monotonic()
        if left > 0:
            time.sleep(left)  # the listener is late, the message still handled
        return handle(msg, route, source)

    monkeypatch.setattr(decode.engine, "_handle", slow_handle)
    for key in ("slow", "next"):
        decode.expect(
            key,
            0,
            time.monotonic() + LOAD_TIMEOUT_S,
            get_from=None,
            prompt_digest=DIGEST,
            prefill_addr=prefill.addr,
        )
    xfer = wait_done(_start(prefill, decode, "slow"))
    assert not xfer.ok and "no reply to Hello" in xfer.reason, xfer.reason
    slot, _ = _wait_failed(decode, "slow", PROMPT_S)
    assert "the prefill gave up sending it" in slot.reason
    decode.release(slot)
    # The slow moment is over: the next transfer goes through at once.
    time.sleep(limits.PEER_RETRY_AFTER_S)
    started = time.monotonic()
    nxt = wait_done(_start(prefill, decode, "next"))
    assert nxt.ok, nxt.reason
    slot, _ = _wait_failed(decode, "next", PROMPT_S)
    assert slot.state is SlotState.COMPLETE
    assert time.monotonic() - started < PROMPT_S
    decode.release(slot)
    # The late Hello's channel never connected and was dropped; nothing held.
    deadline = time.monotonic() + WAIT_S
    while decode.engine.receiver.recv_threads > 1:
        assert time.monotonic() < deadline, "the late Hello's thread never ended"
        time.sleep(0.05)
    assert decode.occupancy() == (0, 0)
