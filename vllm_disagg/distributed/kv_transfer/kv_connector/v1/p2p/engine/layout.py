"""The local KV cache as ``layers x blocks`` of bytes, and what a peer's must match."""

from __future__ import annotations

import ctypes

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.transfers import (
    RecvSlot,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import LayoutSpec


class KVLayout:
    """The registered KV cache tensors seen as ``layers x blocks`` of bytes.

    vLLM 0.32 gives every attention layer a view whose dim 0 is the block
    (logical ``[B, H, N, C]`` for every physical layout, see
    ``vllm/v1/kv_cache_layout.py``); when each block is contiguous in memory
    (the CPU backend's LBHNC, most GPU layouts) blocks are sent straight from
    the cache as byte views, otherwise they are gathered first.
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int):
        if not kv_caches:
            raise ValueError("P2pNcclConnector: no KV cache tensors were registered")
        self.layer_names = list(kv_caches)
        self.tensors = [kv_caches[name] for name in self.layer_names]
        first = self.tensors[0]
        for name, t in zip(self.layer_names, self.tensors):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(
                    "P2pNcclConnector needs one KV cache shape for every layer; "
                    f"{name} has {tuple(t.shape)} {t.dtype}, "
                    f"{self.layer_names[0]} has {tuple(first.shape)} {first.dtype}"
                )
        self.num_blocks = first.shape[0]
        self.block_size = block_size
        self.dtype = first.dtype
        self.device = first.device
        self.page_bytes = first[0].numel() * first.element_size()
        self.blocks_contiguous = all(t[0].is_contiguous() for t in self.tensors)
        self._layer_bytes: list[memoryview | None] = [None] * len(self.tensors)

    @property
    def num_layers(self) -> int:
        return len(self.tensors)

    @property
    def spec(self) -> LayoutSpec:
        return LayoutSpec(
            num_layers=self.num_layers,
            page_bytes=self.page_bytes,
            block_size=self.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def read_blocks(self, layer: int, block_ids: list[int]) -> list[torch.Tensor]:
        """The bytes of ``block_ids`` of one layer, in order, without a copy if
        possible."""
        t = self.tensors[layer]
        if self.blocks_contiguous:
            return [t[b].reshape(-1).view(torch.uint8) for b in block_ids]
        index = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        return [t.index_select(0, index).reshape(-1).view(torch.uint8)]

    def read_block_bytes(self, layer: int, block_ids: list[int]) -> list[memoryview]:
        """The bytes of ``block_ids`` of one layer of a CPU cache whose blocks
        are contiguous, as memoryviews of the cache (one per run of adjacent
        blocks), for a transport that sends host bytes. A torch view per
        block costs a few microseconds, more than moving a 32 KiB block over
        loopback; a memoryview slice costs a tenth of that."""
        if not (self.blocks_contiguous and self.device.type == "cpu"):
            raise ValueError("read_block_bytes needs a CPU cache of contiguous blocks")
        base = self._layer_bytes[layer]
        if base is None:
            base = self._layer_bytes[layer] = self._bytes_of(self.tensors[layer])
        t = self.tensors[layer]
        stride = t.stride(0) * t.element_size()
        page, last = self.page_bytes, self.num_blocks
        views: list[memoryview] = []
        begin = end = -1  # the current run of adjacent blocks, in bytes
        for b in block_ids:
            if not 0 <= b < last:
                raise IndexError(f"block {b} is outside the cache's {last} blocks")
            offset = b * stride
            if offset == end and stride == page:
                end += page
                continue
            if end >= 0:
                views.append(base[begin:end])
            begin, end = offset, offset + page
        if end >= 0:
            views.append(base[begin:end])
        return views

    def _bytes_of(self, t: torch.Tensor) -> memoryview:
        """A byte memoryview from the first block of ``t`` to the end of its
        last; valid while ``t`` lives (this layout keeps it)."""
        nbytes = (self.num_blocks - 1) * t.stride(0) * t.element_size()
        nbytes += self.page_bytes
        raw = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
        return memoryview(raw).cast("B")

    def write_blocks(self, layer: int, block_ids: list[int], src: torch.Tensor) -> bool:
        """Copy ``len(block_ids)`` pages of bytes from ``src`` into the cache;
        True when that was an asynchronous copy from another device (host
        memory into a CUDA cache) that may still be reading ``src``."""
        t = self.tensors[layer]
        pages = src.view(t.dtype).view(len(block_ids), *t.shape[1:])
        crossing = pages.device != t.device
        if crossing:
            pages = pages.to(t.device, non_blocking=True)
        index = torch.tensor(block_ids, dtype=torch.long, device=t.device)
        t.index_copy_(0, index, pages)
        return crossing and t.device.type == "cuda"

    def copy_slot(self, slot: RecvSlot, block_ids: list[int], first_block: int) -> None:
        """Write blocks ``first_block..`` of the prompt from the received
        ``slot`` into ``block_ids``; returns once ``slot`` may be reused."""
        offset = first_block - slot.skip_blocks
        if offset < 0 or offset + len(block_ids) != slot.blocks_held:
            raise ValueError(
                f"received blocks {slot.skip_blocks}..{slot.num_blocks} do not cover "
                f"the {len(block_ids)} blocks from {first_block} this request needs"
            )
        pages = self.page_bytes
        pending = False
        for i in range(slot.num_layers):
            data = slot.layer(i)[offset * pages :]
            pending |= self.write_blocks(i, block_ids, data)
        if pending:
            # The source is a pinned pool block, freed (and free for the next
            # receive to overwrite) once the caller releases the slot: wait
            # until the copies queued on the current stream have read it.
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()


def check_compatible(local: LayoutSpec, remote: LayoutSpec) -> str | None:
    """Why KV from ``remote`` cannot be copied into ``local`` blocks, or None."""
    for name in ("num_layers", "page_bytes", "block_size", "dtype"):
        if getattr(local, name) != getattr(remote, name):
            return (
                f"KV layout mismatch: {name} is {getattr(remote, name)} on the peer "
                f"and {getattr(local, name)} here (same model, dtype and --block-size "
                "needed)"
            )
    return None
