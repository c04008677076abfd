"""Room for what arrives: the receive buffer first, then the host pool.

One per engine, guarded by the engine's lock (passed in); what it hands out
goes back through :meth:`Room.release` once the worker copied the slot (or
nobody will).

Host receive buffers are kept for the next transfer (a free list within the
``kv_buffer_size`` budget): a fresh buffer of tens of MiB is a fresh mmap,
and the kernel's copy into it also takes one page fault per 4 KiB, which
cost more than the copy itself (benchmarks/results/p2p_transfer.md).
"""

from __future__ import annotations

import threading

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    DIGEST_BYTES,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
    KVLayout,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    RecvSlot,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import Offer
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
    P2pStatsRecorder,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.tensor_pool import (
    PoolAllocation,
    TensorMemoryPool,
)

# Kept host receive buffers at most (each within the budget anyway).
MAX_SPARE_BUFFERS = 16


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 1/8 of its power of two (at most
    12.5 % more), so transfers of similar sizes share kept buffers."""
    if nbytes <= 4096:
        return 4096
    step = 1 << max((nbytes - 1).bit_length() - 4, 12)
    return -(-nbytes // step) * step


class Room:
    """The receive buffer's budget (``kv_buffer_size``) and the host pool
    (``mem_pool_size_bytes``, made on first use)."""

    def __init__(
        self,
        lock: threading.Lock,
        layout: KVLayout,
        buffer_size: int,
        pool_size: int,
        stats: P2pStatsRecorder,
    ):
        self.lock = lock
        self.layout = layout
        self.buffer_size = buffer_size
        self.pool_size = pool_size
        self.stats = stats
        self.buffer_used = 0  # capacity of the buffers in use
        self.pool: TensorMemoryPool | None = None
        # Host buffers released and kept for reuse; they count against the
        # budget too (buffer_used + spare_bytes <= buffer_size).
        self.spare: list[torch.Tensor] = []
        self.spare_bytes = 0
        self.reuse = layout.device.type == "cpu"  # CUDA's allocator caches already

    def nbytes(self, blocks: int) -> int:
        """The bytes of ``blocks`` blocks of every layer."""
        return self.layout.num_layers * blocks * self.layout.page_bytes

    def take(
        self, offer: Offer, skip: int, deadline: float, digests: bool
    ) -> RecvSlot | None:
        """A slot for blocks ``skip..`` of ``offer`` (and room for their
        digests: kv_checksum); None when there is no room."""
        blocks = offer.num_blocks - skip
        room = self.allocate(self.nbytes(blocks))
        if room is None:
            return None
        tensor, alloc = room
        n = self.layout.num_layers * blocks * DIGEST_BYTES
        return RecvSlot(
            key=offer.key,
            num_blocks=offer.num_blocks,
            skip_blocks=skip,
            page_bytes=self.layout.page_bytes,
            num_layers=self.layout.num_layers,
            tensor=tensor,
            pool_alloc=alloc,
            deadline=deadline,
            prompt_digest=offer.prompt_digest,
            digests=torch.empty(n, dtype=torch.uint8) if digests else None,
        )

    def allocate(
        self, nbytes: int
    ) -> tuple[torch.Tensor, PoolAllocation | None] | None:
        """Room for ``nbytes``: receive buffer first, then the pool; None if neither."""
        with self.lock:
            if self.buffer_used + nbytes <= self.buffer_size:
                tensor = self._buffer(nbytes)
                self.buffer_used += tensor.untyped_storage().nbytes()
                self._report()
                return tensor, None
            if self.pool_size > 0:
                if self.pool is None:
                    self.pool = TensorMemoryPool(self.pool_size)
                alloc = self.pool.allocate(nbytes)
                if alloc is not None:
                    self.stats.record_spill()
                    self._report()
                    return alloc.tensor, alloc
        return None

    def release(self, slot: RecvSlot) -> None:
        """Return a slot's bytes to the buffer budget or the pool."""
        with self.lock:
            if slot.pool_alloc is not None:
                self.pool.free(slot.pool_alloc)
                slot.pool_alloc = None
            else:
                storage = slot.tensor.untyped_storage()
                self.buffer_used -= storage.nbytes()
                if (
                    self.reuse
                    and storage.nbytes()
                    and len(self.spare) < MAX_SPARE_BUFFERS
                ):
                    # The whole allocation, whatever part the slot used.
                    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
                    self.spare.append(whole)
                    self.spare_bytes += whole.numel()
            slot.tensor = torch.empty(0, dtype=torch.uint8)
            self._report()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of receive buffer: a kept one of the same size class
        when there is one, else a new one of that class (or of exactly
        ``nbytes`` where the class would not fit the budget). Caller holds
        the lock and checked ``buffer_used + nbytes <= buffer_size``."""
        device = self.layout.device
        if not self.reuse or not nbytes:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        capacity = size_class(nbytes)
        for i, spare in enumerate(self.spare):
            if spare.numel() == capacity:
                del self.spare[i]
                self.spare_bytes -= capacity
                if self.buffer_used + capacity <= self.buffer_size:
                    return spare[:nbytes]
                break  # too big for what is left: freed, made exactly below
        if self.buffer_used + capacity > self.buffer_size:
            capacity = nbytes
        # Kept buffers give way to the budget, largest first.
        while self.spare and (
            self.buffer_used + self.spare_bytes + capacity > self.buffer_size
        ):
            largest = max(range(len(self.spare)), key=lambda j: self.spare[j].numel())
            self.spare_bytes -= self.spare.pop(largest).numel()
        return torch.empty(capacity, dtype=torch.uint8, device=device)[:nbytes]

    def occupancy(self) -> tuple[int, int]:
        """(receive buffer bytes, pool bytes) in use."""
        with self.lock:
            return self.buffer_used, self._pool_used()

    def _pool_used(self) -> int:
        return self.pool.used_bytes if self.pool is not None else 0

    def _report(self) -> None:
        self.stats.set_occupancy(self.buffer_used, self._pool_used())
