"""The host tensor memory pool of the P2P KV connector: a buddy allocator
checked against a model of its blocks under random allocate/free sequences,
and the pool's tensor views, copies and thread safety."""

from __future__ import annotations

import random
import sys
import threading

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.tensor_pool import (
    BuddyAllocator,
    TensorMemoryPool,
)

# The same examples on every run (CI must be reproducible) and no shrinking,
# so a failure is reported at once with the sequence that caused it.
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
)

MIN_BLOCK = 256
CAPACITY = 16 * MIN_BLOCK

# ("alloc", nbytes) or ("free", index into the live allocations, modulo their
# count). Mostly small allocations, more of them than frees, so the pool
# fills up and fragments; some larger than the whole pool.
_SIZES = st.one_of(st.integers(1, 2 * MIN_BLOCK), st.integers(1, CAPACITY + MIN_BLOCK))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), _SIZES),
        st.tuples(st.just("alloc"), _SIZES),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    min_size=10,
    max_size=100,
)


def _expected_block(nbytes: int) -> int:
    size = MIN_BLOCK
    while size < nbytes:
        size *= 2
    return size


def _assert_disjoint(blocks: dict[int, int], capacity: int) -> None:
    """Live blocks (offset -> size) lie inside the capacity, aligned, apart."""
    end = 0
    for offset in sorted(blocks):
        size = blocks[offset]
        assert offset >= end and offset % size == 0 and offset + size <= capacity
        end = offset + size


# --- BuddyAllocator -------------------------------------------------------


@pytest.mark.parametrize(
    "capacity, expected",
    [
        (256, 256),
        (511, 256),
        (512, 512),
        (1000, 512),
        (64 * 256 + 255, 64 * 256),
        (127 * 256, 64 * 256),
    ],
)
def test_capacity_is_rounded_down_to_a_power_of_two_number_of_blocks(
    capacity, expected
):
    allocator = BuddyAllocator(capacity, MIN_BLOCK)
    assert allocator.capacity_bytes == expected
    assert allocator.largest_free_block() == expected == allocator.free_bytes
    allocator.check_invariants()


@pytest.mark.parametrize(
    "capacity, min_block", [(255, 256), (0, 256), (4096, 0), (4096, 384)]
)
def test_bad_sizes_are_rejected(capacity, min_block):
    with pytest.raises(ValueError):
        BuddyAllocator(capacity, min_block)


def test_nonpositive_request_is_an_error_and_oversized_request_returns_none():
    allocator = BuddyAllocator(CAPACITY, MIN_BLOCK)
    for nbytes in (0, -1):
        with pytest.raises(ValueError):
            allocator.allocate(nbytes)
    assert allocator.allocate(CAPACITY + 1) is None
    assert allocator.used_bytes == 0
    allocator.check_invariants()


@SETTINGS
@given(ops=OPS, free_order=st.randoms(use_true_random=False))
def test_random_allocate_free_keeps_exact_accounting_and_coalesces(ops, free_order):
    allocator = BuddyAllocator(CAPACITY, MIN_BLOCK)
    live: dict[int, int] = {}  # offset -> block size
    for op, arg in ops:
        if op == "alloc":
            largest = allocator.largest_free_block()
            offset = allocator.allocate(arg)
            size = _expected_block(arg)
            # A buddy allocator fails exactly when no free block is large enough.
            assert (offset is None) == (size > largest)
            if offset is not None:
                assert offset not in live
                live[offset] = size
        elif live:
            offset = sorted(live)[arg % len(live)]
            allocator.free(offset)
            del live[offset]
        allocator.check_invariants()
        _assert_disjoint(live, CAPACITY)
        assert allocator.used_bytes == sum(live.values())
        assert allocator.free_bytes == CAPACITY - allocator.used_bytes

    offsets = list(live)
    free_order.shuffle(offsets)
    for offset in offsets:
        allocator.free(offset)
        allocator.check_invariants()
    assert allocator.used_bytes == 0
    assert allocator.largest_free_block() == CAPACITY


def test_exhaustion_returns_none_and_leaves_state_consistent():
    allocator = BuddyAllocator(CAPACITY, MIN_BLOCK)
    offsets = [allocator.allocate(MIN_BLOCK) for _ in range(CAPACITY // MIN_BLOCK)]
    assert None not in offsets and len(set(offsets)) == len(offsets)
    assert allocator.allocate(1) is None
    assert allocator.largest_free_block() == 0 and allocator.used_bytes == CAPACITY
    allocator.check_invariants()
    # Freeing every other block frees half the bytes but no block of two.
    for offset in offsets[::2]:
        allocator.free(offset)
    assert allocator.allocate(MIN_BLOCK + 1) is None
    assert allocator.free_bytes == CAPACITY // 2
    allocator.check_invariants()


@pytest.mark.parametrize("bad", ["double", "unknown", "inside"])
def test_bad_free_is_rejected_without_changing_state(bad):
    allocator = BuddyAllocator(CAPACITY, MIN_BLOCK)
    a = allocator.allocate(4 * MIN_BLOCK)
    b = allocator.allocate(MIN_BLOCK)
    if bad == "double":
        allocator.free(b)
        offset = b
    else:
        offset = {"unknown": CAPACITY - MIN_BLOCK, "inside": a + MIN_BLOCK}[bad]
    used, largest = allocator.used_bytes, allocator.largest_free_block()
    with pytest.raises(ValueError):
        allocator.free(offset)
    assert (allocator.used_bytes, allocator.largest_free_block()) == (used, largest)
    allocator.check_invariants()
    allocator.free(a)
    if bad != "double":
        allocator.free(b)
    assert allocator.largest_free_block() == CAPACITY


# --- TensorMemoryPool -----------------------------------------------------


def _pool() -> TensorMemoryPool:
    return TensorMemoryPool(CAPACITY, pin_memory=False, min_block_bytes=MIN_BLOCK)


def test_pool_is_not_pinned_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the default is pinned")
    assert not TensorMemoryPool(CAPACITY, min_block_bytes=MIN_BLOCK).pin_memory


@SETTINGS
@given(ops=OPS)
def test_pool_views_are_disjoint_and_accounting_is_exact(ops):
    pool = _pool()
    base = pool.allocate(1)
    base_ptr = base.tensor.data_ptr() - base.offset
    pool.free(base)
    live = []  # (allocation, fill byte)
    for i, (op, arg) in enumerate(ops):
        if op == "alloc":
            alloc = pool.allocate(arg)
            if alloc is not None:
                assert alloc.tensor.dtype == torch.uint8
                assert alloc.tensor.numel() == alloc.nbytes == arg
                assert alloc.size == _expected_block(arg)
                assert alloc.tensor.data_ptr() == base_ptr + alloc.offset
                fill = i % 255 + 1
                alloc.tensor.fill_(fill)
                live.append((alloc, fill))
        elif live:
            alloc, _ = live.pop(arg % len(live))
            pool.free(alloc)
        for alloc, fill in live:
            assert bool((alloc.tensor == fill).all()), "a live allocation was clobbered"
        assert pool.num_allocations == len(live)
        assert pool.requested_bytes == sum(a.nbytes for a, _ in live)
        assert pool.used_bytes == sum(a.size for a, _ in live)
    for alloc, _ in live:
        pool.free(alloc)
    assert pool.used_bytes == pool.requested_bytes == pool.num_allocations == 0
    assert pool.allocate(CAPACITY) is not None  # fully coalesced


def test_pool_rejects_double_free_foreign_and_stale_allocations():
    pool, other = _pool(), _pool()
    a = pool.allocate(100)
    pool.free(a)
    with pytest.raises(ValueError):
        pool.free(a)
    # The stale object's offset now belongs to a new allocation, which survives.
    b = pool.allocate(100)
    assert b.offset == a.offset
    with pytest.raises(ValueError):
        pool.free(a)
    with pytest.raises(ValueError):
        pool.free(other.allocate(100))
    assert (pool.num_allocations, pool.requested_bytes, pool.used_bytes) == (
        1,
        100,
        MIN_BLOCK,
    )
    pool.free(b)
    assert pool.used_bytes == 0


def test_pool_exhaustion_returns_none():
    pool = _pool()
    big = pool.allocate(CAPACITY)
    assert pool.allocate(1) is None
    assert pool.allocate(CAPACITY + 1) is None
    assert (pool.num_allocations, pool.requested_bytes) == (1, CAPACITY)
    pool.free(big)
    assert pool.allocate(CAPACITY) is not None


def test_closed_pool_allocates_nothing_and_free_is_a_noop():
    pool = _pool()
    alloc = pool.allocate(100)
    pool.close()
    assert pool.allocate(1) is None
    pool.free(alloc)
    assert pool.used_bytes == pool.requested_bytes == pool.num_allocations == 0
    with pytest.raises(ValueError):
        pool.copy_out(alloc, torch.empty(100, dtype=torch.uint8))


def test_concurrent_allocate_and_free():
    pool = _pool()
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        try:
            start.wait()
            for _ in range(10000):
                if held and (rng.random() < 0.5 or len(held) > 8):
                    alloc, fill = held.pop(rng.randrange(len(held)))
                    assert bool((alloc.tensor == fill).all()), (
                        "clobbered by another thread"
                    )
                    pool.free(alloc)
                else:
                    alloc = pool.allocate(rng.randint(1, 4 * MIN_BLOCK))
                    if alloc is not None:
                        fill = rng.randint(0, 255)
                        alloc.tensor.fill_(fill)
                        held.append((alloc, fill))
            for alloc, _ in held:
                pool.free(alloc)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside the pool's methods too
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert pool.used_bytes == pool.requested_bytes == pool.num_allocations == 0
    pool._allocator.check_invariants()
    assert pool.allocate(CAPACITY) is not None


@pytest.mark.parametrize(
    "dtype, shape",
    [
        (torch.float32, (3, 5)),
        (torch.bfloat16, (7,)),
        (torch.int64, (2, 2, 2)),
        (torch.uint8, (1,)),
    ],
)
def test_copy_round_trip_on_cpu(dtype, shape):
    pool = _pool()
    src = torch.arange(torch.Size(shape).numel()).reshape(shape).to(dtype)
    alloc = pool.allocate(src.nbytes)
    pool.copy_in(alloc, src)
    dst = torch.empty_like(src)
    pool.copy_out(alloc, dst)
    assert torch.equal(dst, src)


def test_copy_rejects_wrong_size_non_contiguous_and_freed():
    pool = _pool()
    alloc = pool.allocate(64)
    with pytest.raises(ValueError):
        pool.copy_in(alloc, torch.zeros(15, dtype=torch.float32))
    with pytest.raises(ValueError):
        pool.copy_out(alloc, torch.zeros(4, 8, dtype=torch.float32)[:, ::2])
    pool.free(alloc)
    with pytest.raises(ValueError):
        pool.copy_in(alloc, torch.zeros(16, dtype=torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_pool_copies_to_and_from_cuda_on_a_side_stream():
    pool = TensorMemoryPool(1 << 24)
    assert pool.pin_memory
    src = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
    alloc = pool.allocate(src.nbytes)
    assert alloc.tensor.is_pinned()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pool.copy_in(alloc, src, non_blocking=True)
        copied_in = torch.cuda.Event()
        copied_in.record()
    copied_in.synchronize()
    assert torch.equal(alloc.tensor, src.cpu().view(-1).view(torch.uint8))

    dst = torch.empty_like(src)
    with torch.cuda.stream(stream):
        pool.copy_out(alloc, dst, non_blocking=True)
        copied_out = torch.cuda.Event()
        copied_out.record()
    copied_out.synchronize()
    pool.free(alloc)
    assert torch.equal(dst, src)
