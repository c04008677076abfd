"""Room for what arrives: the receive buffer first, then the host pool.

One per engine, guarded by the engine's lock (passed in); what it hands out
goes back through :meth:`Room.release` once the worker copied the slot (or
nobody will).
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
        self.buffer_used = 0
        self.pool: TensorMemoryPool | None = None

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
                self.buffer_used += nbytes
                tensor = torch.empty(
                    nbytes, dtype=torch.uint8, device=self.layout.device
                )
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
                self.buffer_used -= slot.nbytes
            slot.tensor = torch.empty(0, dtype=torch.uint8)
            self._report()

    def occupancy(self) -> tuple[int, int]:
        """(receive buffer bytes, pool bytes) in use."""
        with self.lock:
            return self.buffer_used, self._pool_used()

    def _pool_used(self) -> int:
        return self.pool.used_bytes if self.pool is not None else 0

    def _report(self) -> None:
        self.stats.set_occupancy(self.buffer_used, self._pool_used())
