"""The worker's side of PUT and PUT_ASYNC: when the offer goes, and what the
model thread waits for. Two real engines in one process (``make_engine``),
driven through the worker's own ``bind`` / ``save_kv_layer`` /
``wait_for_save`` calls as vLLM makes them around a forward pass."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import SendType
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import SlotState
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import (
    P2pConnectorMetadata,
    SaveSpec,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.worker import (
    P2pWorkerConnector,
)

from .test_engine import (
    DIGEST,
    LAYERS,
    PAGE,
    assert_blocks_equal,
    assert_nothing_held,
    deadline,
    receive,
    wait_for,
)


def _worker(node, send_type: SendType) -> P2pWorkerConnector:
    """The worker connector around ``node``'s engine, without vLLM's
    distributed state (only the per-step calls run here)."""
    worker = P2pWorkerConnector.__new__(P2pWorkerConnector)
    worker.config = SimpleNamespace(send_type=send_type)
    worker.engine = node.engine
    worker.rank_offset = 0
    worker.layer_index = {name: i for i, name in enumerate(node.kv)}
    worker._meta = None
    worker._loads = {}
    worker._streaming, worker._offered = [], []
    worker._sends, worker._finished_requests = {}, set()
    worker._handled_at_bind = None
    return worker


def _send_of_k_started(make_engine, send_type: SendType, *, expect: bool):
    """A prefill whose worker started, in bind, the send of key "k" (blocks
    1 and 2) to a decode; the decode expects "k" from that prefill when
    ``expect``. Holds of 20 s (prefill) and 30 s (decode): what the tests
    below must beat by far. Returns (prefill, decode, worker)."""
    prefill = make_engine("tcp", send_type.value, seed=1, hold=20.0)
    decode = make_engine("tcp", send_type.value, seed=2, hold=30.0)
    worker = _worker(prefill, send_type)
    if expect:
        decode.expect(
            "k",
            0,
            deadline(30),
            get_from=None,
            prompt_digest=DIGEST,
            prefill_addr=prefill.addr,  # as the decode's worker names it
        )
    worker.bind(
        P2pConnectorMetadata(
            saves=[SaveSpec("req-k", "k", decode.addr, [1, 2], DIGEST)]
        )
    )
    return prefill, decode, worker


@pytest.mark.parametrize("send_type", [SendType.PUT, SendType.PUT_ASYNC])
def test_the_offer_goes_before_the_forward_pass_and_the_kv_after_it(
    make_engine, send_type
):
    # The Offer's round trip (room on the decode) overlaps the forward pass
    # in both PUT modes; PUT's model thread then waits in wait_for_save
    # until the send ended, PUT_ASYNC's does not.
    prefill = make_engine("tcp", send_type.value, seed=1)
    decode = make_engine("tcp", send_type.value, seed=2)
    worker = _worker(prefill, send_type)
    src, dst = [3, 5, 7], [30, 31, 32]
    decode.expect("k", 0, deadline(), get_from=None, prompt_digest=DIGEST)
    worker.bind(
        P2pConnectorMetadata(saves=[SaveSpec("req-k", "k", decode.addr, src, DIGEST)])
    )
    # "The forward pass": the decode has reserved room, nothing has arrived.
    wait_for(
        lambda: decode.occupancy() == (LAYERS * len(src) * PAGE, 0),
        "the offer to reserve room on the decode",
    )
    assert decode.poll("k") is None
    if send_type is SendType.PUT_ASYNC:
        for name in prefill.kv:
            worker.save_kv_layer(name)
    waited = threading.Event()
    saver = threading.Thread(target=lambda: (worker.wait_for_save(), waited.set()))
    saver.start()
    saver.join(10)
    assert waited.is_set()
    xfer = worker._sends["req-k"]
    if send_type is SendType.PUT:
        assert xfer.done.is_set() and xfer.ok, xfer.reason  # waited for it
    receive(decode, "k", dst, 0)
    assert xfer.done.wait(10) and xfer.ok, xfer.reason
    assert_blocks_equal(decode, dst, prefill, src)
    assert_nothing_held(decode)
    worker.clear()
    assert not worker._offered and not worker._streaming


def test_put_waits_for_layers_until_wait_for_save(make_engine):
    # PUT offers early but sends nothing before the pass is done.
    prefill = make_engine("tcp", "PUT", seed=1)
    decode = make_engine("tcp", "PUT", seed=2)
    worker = _worker(prefill, SendType.PUT)
    decode.expect("k", 0, deadline(), get_from=None, prompt_digest=DIGEST)
    worker.bind(
        P2pConnectorMetadata(saves=[SaveSpec("req-k", "k", decode.addr, [1], DIGEST)])
    )
    for name in prefill.kv:  # PUT ignores the per-layer hook
        worker.save_kv_layer(name)
    time.sleep(0.2)
    assert decode.poll("k") is None
    assert not worker._sends["req-k"].done.is_set()
    worker.wait_for_save()
    receive(decode, "k", [40], 0)
    assert_blocks_equal(decode, [40], prefill, [1])


@pytest.mark.parametrize("send_type", [SendType.PUT, SendType.PUT_ASYNC])
@pytest.mark.parametrize("expected", [True, False], ids=["expected", "not-yet"])
def test_an_engine_closed_between_bind_and_wait_for_save_tells_the_decode_at_once(
    make_engine, send_type, expected
):
    # The offer went in bind and reserved room on the decode; then the
    # prefill shuts down before any layer is saved. Its close must not wait
    # for the send's deadline (kv_hold_timeout_s) and the decode must learn
    # now, not at its kv_load_timeout_s (adversarial review, finding F1).
    prefill, decode, worker = _send_of_k_started(
        make_engine, send_type, expect=expected
    )
    wait_for(lambda: decode.occupancy()[0] > 0, "the offer's room", 10)
    start = time.monotonic()
    prefill.engine.close()
    closed_in = time.monotonic() - start
    slot = wait_for(lambda: decode.poll("k"), "the failed slot", 10)
    learned_in = time.monotonic() - start
    # Bounds for a loaded 2-core host; the deadline they guard is 20 s.
    assert closed_in < 5.0, closed_in
    assert learned_in < 5.0, learned_in
    assert slot.state is SlotState.FAILED
    xfer = worker._sends["req-k"]
    assert xfer.done.is_set() and not xfer.ok and "closing" in xfer.reason
    decode.release(slot)
    assert decode.occupancy() == (0, 0)


@contextmanager
def _forward_pass(worker: P2pWorkerConnector) -> Iterator[None]:
    """As vLLM's model runner wraps a pass: wait_for_save in a `finally`."""
    try:
        yield
    finally:
        worker.wait_for_save()


@pytest.mark.parametrize("send_type", [SendType.PUT, SendType.PUT_ASYNC])
def test_kv_of_a_forward_pass_that_raised_is_not_sent(make_engine, send_type):
    # The pass computed (saved) the first layer, then raised. wait_for_save
    # still runs, in vLLM's `finally`: it must not mark the other layers
    # saved and send what the cache held before; the send fails and the
    # decode learns at once (adversarial review, finding F3).
    prefill, decode, worker = _send_of_k_started(make_engine, send_type, expect=True)
    start = time.monotonic()
    with pytest.raises(RuntimeError), _forward_pass(worker):
        worker.save_kv_layer(next(iter(prefill.kv)))
        raise RuntimeError("the forward pass")
    returned_in = time.monotonic() - start
    slot = wait_for(lambda: decode.poll("k"), "the failed slot", 10)
    learned_in = time.monotonic() - start
    # Bounds for a loaded 2-core host; the deadline they guard is 20 s.
    assert returned_in < 2.0, returned_in
    assert learned_in < 5.0, learned_in
    assert slot.state is SlotState.FAILED
    xfer = worker._sends["req-k"]
    assert xfer.done.wait(5) and not xfer.ok
    assert "forward pass raised RuntimeError" in xfer.reason, xfer.reason
    assert not worker._offered and not worker._streaming
    decode.release(slot)
    assert decode.occupancy() == (0, 0)


def test_get_answers_gone_for_a_forward_pass_that_raised(make_engine):
    # GET holds the KV for a pull: of a pass that raised it is filed failed,
    # so the decode's Get is answered `gone` and its load fails at once (not
    # at kv_load_timeout_s), and vLLM is told the blocks are free.
    prefill = make_engine("tcp", "GET", seed=1, hold=20.0)
    decode = make_engine("tcp", "GET", seed=2, hold=30.0)
    worker = _worker(prefill, SendType.GET)
    worker.bind(
        P2pConnectorMetadata(
            saves=[SaveSpec("req-k", "k", decode.addr, [1, 2], DIGEST)]
        )
    )
    with pytest.raises(RuntimeError), _forward_pass(worker):
        raise RuntimeError("the forward pass")
    xfer = worker._sends["req-k"]
    assert xfer.done.is_set() and not xfer.ok, xfer.reason
    assert "forward pass raised" in xfer.reason
    start = time.monotonic()
    decode.expect("k", 0, deadline(30), get_from=prefill.addr, prompt_digest=DIGEST)
    slot = wait_for(lambda: decode.poll("k"), "the failed slot", 10)
    assert time.monotonic() - start < 5.0  # a loaded host; the timeout is 30 s
    assert slot.state is SlotState.FAILED
    decode.release(slot)
    results = worker.get_transfer_results({"req-k"})
    assert results.finished_sending == {"req-k"}


def test_a_pass_raising_inside_a_callers_except_block_fails_its_sends(
    make_engine,
):
    prefill = make_engine("tcp", "PUT", seed=1)
    worker = _worker(prefill, SendType.PUT)
    try:
        raise KeyError("handled by the caller")
    except KeyError:
        worker.bind(
            P2pConnectorMetadata(
                saves=[SaveSpec("req-k", "k", "127.0.0.1:1", [1], DIGEST)]
            )
        )
        with pytest.raises(RuntimeError), _forward_pass(worker):
            raise RuntimeError("the forward pass") from None
    xfer = worker._sends["req-k"]
    assert xfer.done.wait(10) and not xfer.ok
    assert "forward pass raised RuntimeError" in xfer.reason, xfer.reason


def test_a_step_run_inside_a_callers_except_block_still_sends(make_engine):
    # sys.exc_info() sees an exception a caller up the stack is handling;
    # a pass that raised nothing must not be taken for one that did.
    prefill = make_engine("tcp", "PUT", seed=1)
    decode = make_engine("tcp", "PUT", seed=2)
    worker = _worker(prefill, SendType.PUT)
    decode.expect("k", 0, deadline(), get_from=None, prompt_digest=DIGEST)
    try:
        raise KeyError("handled by the caller")
    except KeyError:
        worker.bind(
            P2pConnectorMetadata(
                saves=[SaveSpec("req-k", "k", decode.addr, [1], DIGEST)]
            )
        )
        with _forward_pass(worker):
            pass
    receive(decode, "k", [40], 0)
    xfer = worker._sends["req-k"]
    assert xfer.done.wait(10) and xfer.ok, xfer.reason
    assert_blocks_equal(decode, [40], prefill, [1])
