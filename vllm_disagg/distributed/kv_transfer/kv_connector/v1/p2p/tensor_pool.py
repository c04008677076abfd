"""Host memory for received KV that does not fit the device receive buffer.

On a decode instance, KV received from a prefill instance waits in a receive
buffer until the model thread copies it into the KV cache. Bytes beyond the
device budget (``kv_buffer_size``) spill to a :class:`TensorMemoryPool`: one
host allocation (pinned when CUDA is available, so copies to the device can
be asynchronous) carved up by a :class:`BuddyAllocator`.

Unlike the upstream pool this replaces, the pool never raises on exhaustion
(``allocate`` returns ``None`` and the caller falls back to recomputing the
prompt), accounts for every byte exactly, and is safe to use from two
threads: the receiver thread allocates, the model thread frees.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from vllm.logger import init_logger

logger = init_logger(__name__)


class BuddyAllocator:
    """Buddy-system allocator of offsets into ``[0, capacity_bytes)``.

    Blocks are ``min_block_bytes * 2**order`` bytes and aligned to their
    size, so a block's buddy is at ``offset ^ size`` and a freed block merges
    with its free buddy in O(log capacity), as in Linux's page allocator.
    Only offsets are managed (no memory, no torch). Not thread safe: the
    caller serialises calls (:class:`TensorMemoryPool` holds a lock).
    """

    def __init__(self, capacity_bytes: int, min_block_bytes: int = 4096):
        if min_block_bytes <= 0 or min_block_bytes & (min_block_bytes - 1):
            raise ValueError(
                f"min_block_bytes must be a power of two, got {min_block_bytes}"
            )
        if capacity_bytes < min_block_bytes:
            raise ValueError(
                f"capacity_bytes ({capacity_bytes}) is below min_block_bytes "
                f"({min_block_bytes})"
            )
        self.min_block_bytes = min_block_bytes
        # Rounded down to a power-of-two number of minimum blocks: the whole
        # capacity is one block of the top order.
        self.max_order = (capacity_bytes // min_block_bytes).bit_length() - 1
        self.capacity_bytes = min_block_bytes << self.max_order
        # Free block offsets per order; sets make removing a buddy O(1).
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._free[self.max_order].add(0)
        self._allocated: dict[int, int] = {}  # offset -> order
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def block_size(self, nbytes: int) -> int:
        """Size of the block that ``allocate(nbytes)`` reserves."""
        return self.min_block_bytes << self._order(nbytes)

    def _order(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        blocks = -(-nbytes // self.min_block_bytes)
        return (blocks - 1).bit_length()

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a free block of at least ``nbytes``, or None when no free
        block is that large (including ``nbytes > capacity_bytes``).

        ``nbytes <= 0`` is a caller bug and raises ValueError.
        """
        order = self._order(nbytes)
        found = next(
            (o for o in range(order, self.max_order + 1) if self._free[o]),
            None,
        )
        if found is None:
            return None
        offset = self._free[found].pop()
        # Split: keep the low half, give the high half back at each order.
        while found > order:
            found -= 1
            self._free[found].add(offset + (self.min_block_bytes << found))
        self._allocated[offset] = order
        self.used_bytes += self.min_block_bytes << order
        return offset

    def free(self, offset: int) -> None:
        """Return the block at ``offset``; raises ValueError (state unchanged)
        when no block starts there (unknown offset or double free)."""
        order = self._allocated.pop(offset, None)
        if order is None:
            raise ValueError(f"offset {offset} is not an allocated block")
        self.used_bytes -= self.min_block_bytes << order
        while order < self.max_order:
            buddy = offset ^ (self.min_block_bytes << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)

    def largest_free_block(self) -> int:
        """Largest request that ``allocate`` can satisfy now (0 when full)."""
        for order in range(self.max_order, -1, -1):
            if self._free[order]:
                return self.min_block_bytes << order
        return 0

    def check_invariants(self) -> None:
        """Raise AssertionError unless the free and allocated blocks tile the
        capacity exactly, are aligned, and no two free buddies are unmerged."""
        blocks = [(off, order) for order, offs in enumerate(self._free) for off in offs]
        blocks += self._allocated.items()
        end = 0
        for offset, order in sorted(blocks):
            size = self.min_block_bytes << order
            if offset != end or offset % size:
                raise AssertionError(
                    f"block {offset}+{size}: overlap, gap or misaligned"
                )
            end = offset + size
        if end != self.capacity_bytes:
            raise AssertionError(f"blocks cover {end} of {self.capacity_bytes} bytes")
        for order, offsets in enumerate(self._free[: self.max_order]):
            for offset in offsets:
                if offset ^ (self.min_block_bytes << order) in offsets:
                    raise AssertionError(
                        f"free buddies at {offset} (order {order}) not merged"
                    )
        used = sum(self.min_block_bytes << order for order in self._allocated.values())
        if used != self.used_bytes:
            raise AssertionError(
                f"used_bytes is {self.used_bytes}, blocks add up to {used}"
            )


@dataclass(frozen=True, eq=False)
class PoolAllocation:
    """A live block of a :class:`TensorMemoryPool`. ``tensor`` is a uint8 view
    of exactly ``nbytes`` (of a ``size``-byte block); it must not be used
    after :meth:`TensorMemoryPool.free`, when the memory may be handed out
    again."""

    offset: int
    nbytes: int
    size: int
    tensor: torch.Tensor


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("pool copies need a contiguous tensor")
    return t.reshape(-1).view(torch.uint8)


class TensorMemoryPool:
    """A host tensor of ``size_bytes`` (rounded down to ``min_block_bytes *
    2**k``) handed out in buddy blocks; every method is thread safe.

    The whole tensor is allocated here, once: the engine builds the pool
    lazily, on the first spill, so a worker that never spills pays nothing.
    """

    def __init__(
        self,
        size_bytes: int,
        *,
        pin_memory: bool | None = None,
        min_block_bytes: int = 4096,
    ):
        self._allocator = BuddyAllocator(size_bytes, min_block_bytes)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pin_memory = pin_memory
        self._buffer: torch.Tensor | None = torch.empty(
            self._allocator.capacity_bytes, dtype=torch.uint8, pin_memory=pin_memory
        )
        self._lock = threading.Lock()
        self._live: dict[int, PoolAllocation] = {}  # offset -> allocation
        self._requested_bytes = 0
        logger.info(
            "KV tensor memory pool: %.2f GiB of host memory%s (%d bytes asked)",
            self._allocator.capacity_bytes / 2**30,
            " (pinned)" if pin_memory else "",
            size_bytes,
        )

    @property
    def capacity_bytes(self) -> int:
        return self._allocator.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by live allocations (whole blocks)."""
        with self._lock:
            return self._allocator.used_bytes

    @property
    def requested_bytes(self) -> int:
        """Bytes asked for by live allocations (``sum(a.nbytes)``)."""
        with self._lock:
            return self._requested_bytes

    @property
    def num_allocations(self) -> int:
        with self._lock:
            return len(self._live)

    def allocate(self, nbytes: int) -> PoolAllocation | None:
        """A block of at least ``nbytes``, or None when the pool has no free
        block that large or is closed. ``nbytes <= 0`` raises ValueError."""
        with self._lock:
            if self._buffer is None:
                return None
            offset = self._allocator.allocate(nbytes)
            if offset is None:
                return None
            alloc = PoolAllocation(
                offset=offset,
                nbytes=nbytes,
                size=self._allocator.block_size(nbytes),
                tensor=self._buffer[offset : offset + nbytes],
            )
            self._live[offset] = alloc
            self._requested_bytes += nbytes
            return alloc

    def free(self, alloc: PoolAllocation) -> None:
        """Return ``alloc`` to the pool. Freeing an allocation twice, or one
        of another pool, raises ValueError and changes nothing. After
        :meth:`close` this is a no-op: the allocations died with the pool."""
        with self._lock:
            if self._buffer is None:
                return
            self._check_live(alloc)
            self._allocator.free(alloc.offset)
            del self._live[alloc.offset]
            self._requested_bytes -= alloc.nbytes

    def close(self) -> None:
        """Drop the backing tensor and every allocation; later ``allocate``
        calls return None. The memory is released once no view of it
        (``PoolAllocation.tensor``) is left."""
        with self._lock:
            self._buffer = None
            for offset in self._live:
                self._allocator.free(offset)
            self._live.clear()
            self._requested_bytes = 0

    def copy_in(
        self, alloc: PoolAllocation, src: torch.Tensor, *, non_blocking: bool = False
    ) -> None:
        """Copy the bytes of contiguous ``src`` (any device and dtype, exactly
        ``alloc.nbytes``) into the pool.

        With ``non_blocking`` a copy from a CUDA tensor is queued on the
        current stream (pick one with ``torch.cuda.stream``); the caller
        synchronises that stream before reading the bytes or freeing
        ``alloc``.
        """
        self._check_copy(alloc, src)
        alloc.tensor.copy_(_byte_view(src), non_blocking=non_blocking)

    def copy_out(
        self, alloc: PoolAllocation, dst: torch.Tensor, *, non_blocking: bool = False
    ) -> None:
        """Copy the pool bytes into contiguous ``dst`` (any device and dtype,
        exactly ``alloc.nbytes``).

        With ``non_blocking`` a copy to a CUDA tensor from the pinned pool is
        queued on the current stream; the caller synchronises that stream
        (or an event recorded after the copy) before freeing ``alloc``, or a
        new allocation could overwrite the bytes before the copy reads them.
        """
        self._check_copy(alloc, dst)
        _byte_view(dst).copy_(alloc.tensor, non_blocking=non_blocking)

    def _check_live(self, alloc: PoolAllocation) -> None:
        if self._live.get(alloc.offset) is not alloc:
            raise ValueError(
                f"allocation at offset {alloc.offset} is not live in this pool"
            )

    def _check_copy(self, alloc: PoolAllocation, t: torch.Tensor) -> None:
        with self._lock:
            self._check_live(alloc)
        if t.nbytes != alloc.nbytes:
            raise ValueError(f"tensor has {t.nbytes} bytes, allocation {alloc.nbytes}")
