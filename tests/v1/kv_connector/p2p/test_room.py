"""The receive room's buffer reuse: a released host buffer serves the next
transfer of its size class, and the bytes held (in use plus kept) never pass
``kv_buffer_size``, whatever the order of allocations and releases."""

from __future__ import annotations

import threading

import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
    KVLayout,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.room import (
    MAX_SPARE_BUFFERS,
    Room,
    size_class,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    RecvSlot,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pStatsRecorder,
)

SETTINGS = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
)
PAGE = 4096
BUDGET = 64 * PAGE


def _room(budget: int = BUDGET) -> Room:
    kv = {"layer.0": torch.zeros(8, PAGE, dtype=torch.uint8)}
    return Room(threading.Lock(), KVLayout(kv, 16), budget, 0, P2pStatsRecorder())


def _slot(tensor: torch.Tensor) -> RecvSlot:
    return RecvSlot(
        key="k",
        num_blocks=1,
        skip_blocks=0,
        page_bytes=tensor.numel(),
        num_layers=1,
        tensor=tensor,
        pool_alloc=None,
        deadline=0.0,
    )


def test_size_classes_round_up_by_at_most_an_eighth():
    for nbytes in (1, 4096, 4097, 9000, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 5):
        cls = size_class(nbytes)
        assert cls >= nbytes and cls % 4096 == 0
        assert cls - nbytes < max(nbytes // 8 + 1, 4096)
        assert size_class(cls) == cls


def test_a_released_buffer_serves_the_next_transfer_of_its_class():
    room = _room()
    tensor, _ = room.allocate(10 * PAGE)
    first = tensor.data_ptr()
    room.release(_slot(tensor))
    assert room.occupancy() == (0, 0) and room.spare_bytes == 10 * PAGE
    again, _ = room.allocate(10 * PAGE - 100)  # the same class
    assert again.data_ptr() == first and again.numel() == 10 * PAGE - 100
    assert room.occupancy() == (10 * PAGE, 0) and room.spare_bytes == 0
    other, _ = room.allocate(20 * PAGE)  # another class: a new buffer
    assert other.data_ptr() != first


def test_kept_buffers_give_way_to_the_budget():
    room = _room()
    tensor, _ = room.allocate(40 * PAGE)
    room.release(_slot(tensor))
    # 40 pages kept and 30 new ones would pass the 64-page budget: the kept
    # buffer is freed, the allocation is not refused.
    new, _ = room.allocate(30 * PAGE)
    assert new.numel() == 30 * PAGE
    assert room.spare_bytes == 0 and room.occupancy()[0] == 30 * PAGE


def test_a_class_that_does_not_fit_falls_back_to_the_exact_size():
    room = _room(budget=9 * PAGE + 1)
    tensor, _ = room.allocate(9 * PAGE + 1)  # its class (10 pages) > budget
    assert tensor.untyped_storage().nbytes() == 9 * PAGE + 1
    assert room.allocate(1) is None  # the budget is full, nothing else fits


# ("alloc", bytes) or ("free", index into the live buffers modulo their count)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, BUDGET + PAGE)),
        st.tuples(st.just("alloc"), st.sampled_from([PAGE, 5 * PAGE, 17 * PAGE])),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@SETTINGS
@given(OPS)
def test_the_bytes_held_never_pass_the_budget(ops):
    room = _room()
    live: list[torch.Tensor] = []
    for op, arg in ops:
        if op == "alloc":
            fits = room.buffer_used + arg <= BUDGET  # kept buffers never refuse
            got = room.allocate(arg)
            assert (got is not None) == fits
            if got is not None:
                tensor, alloc = got
                assert alloc is None and tensor.numel() == arg
                if arg:  # each live buffer is its own memory
                    lo, hi = tensor.data_ptr(), tensor.data_ptr() + arg
                    for t in live:
                        if t.numel():
                            assert hi <= t.data_ptr() or lo >= t.data_ptr() + t.numel()
                live.append(tensor)
        elif live:
            room.release(_slot(live.pop(arg % len(live))))
        held = room.buffer_used + room.spare_bytes
        assert held <= BUDGET
        assert room.buffer_used == sum(t.untyped_storage().nbytes() for t in live)
        assert room.spare_bytes == sum(t.numel() for t in room.spare)
        assert len(room.spare) <= MAX_SPARE_BUFFERS
