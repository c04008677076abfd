"""Byte views of CPU tensors' memory, no copy: what the tcp transport sends
from and receives into, and what the KV checksums hash.

A torch or numpy view per KV block costs more CPU than hashing or sending the
block's 32 KiB, so callers take one ``memoryview`` of each underlying storage
and slice it; ``bases`` keeps those storage views for one call.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@functools.lru_cache(maxsize=256)
def _byte_array(nbytes: int) -> type[ctypes.Array]:
    return ctypes.c_ubyte * nbytes


def storage_view(
    tensor: torch.Tensor, bases: dict[int, memoryview]
) -> tuple[memoryview, int]:
    """A writable byte view of the whole storage under ``tensor`` (a CPU
    tensor; the caller checks) and ``tensor``'s byte offset in it. ``bases``
    maps a storage's address to its view, so tensors of one storage share it.
    The caller keeps the tensor alive while the view is used."""
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    base = bases.get(start)
    if base is None:
        raw = _byte_array(storage.nbytes()).from_address(start)
        base = bases[start] = memoryview(raw).cast("B")
    return base, tensor.data_ptr() - start
