"""Per-block checksums of the KV bytes a transfer moves (``kv_checksum``).

With a checksum on, the sender hashes every block of every layer message it
writes, over the very bytes it hands to the transport, and appends the
digests to that message as one small tensor (8 bytes a block: a little-endian
uint64, 32-bit CRCs zero-extended), so the data channel carries as many
messages as without it. The receiver receives the layer and its digests in
one call, hashes the blocks it got and compares them before the slot can
reach the worker: a mismatch discards the whole transfer (the load fails and
vLLM recomputes), counts ``checksum_mismatches`` and is logged, rate-limited.
The Hello names the algorithm; a receiver refuses a channel whose sender
attaches another one (or none while it expects one), so both ends always agree
on what a message holds.

What it catches: bytes that changed between the sender's read of its KV cache
and the receiver's buffer (a transport, NIC, driver or memory fault, a bug
that misplaces bytes in a message). What it does not: KV that was wrong
before it was read (the prompt digest and the model fingerprint cover which
KV it is), or a forger who recomputes the digests (the data plane is not
authenticated; the control plane's MAC covers the messages, not the bytes).

Which algorithms (``benchmarks/p2p_checksum.py``, results/p2p_checksum.md,
and docs/p2p_connector.md for the figures): operators may choose
:data:`OFFERED`. ``crc32c`` (PyPI ``crc32c``, a dependency of this package:
SSE4.2/ARMv8 CRC instructions) was as fast as ``xxh3_64`` per block and is
called so that it releases the GIL on every block: a receive thread that
hashes a layer never stalls the worker's model thread. ``crc32`` (the
standard library's zlib) is there without any package, about a third as
fast. ``xxh3_64`` (PyPI ``xxhash``) and ``blake3`` are measured, not offered:
xxhash holds the GIL for a whole layer's blocks (other threads stalled up to
hundreds of milliseconds on a loaded machine), blake3 was the slowest but
one and released it only in part. Only CPU KV caches are hashed here (the
tcp and gloo transports); docs/p2p_connector.md says how it would run with
NCCL.
"""

from __future__ import annotations

import array
import importlib
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.host_memory import (
    storage_view,
)

if TYPE_CHECKING:  # torch is imported on use: config.py reads OFFERED cheaply
    import torch

NONE = "none"
DIGEST_BYTES = 8  # per block, whatever the algorithm


@dataclass(frozen=True)
class _Algorithm:
    package: str  # what pip installs; "" for the standard library
    make: Callable[[], Callable[[memoryview], int]]  # imports, returns the hash


def _xxh3_64() -> Callable[[memoryview], int]:
    return importlib.import_module("xxhash").xxh3_64_intdigest


def _crc32c() -> Callable[[memoryview], int]:
    crc32c = importlib.import_module("crc32c").crc32c
    # value 0; gil_release_mode 1: release the GIL on every call (by default
    # the library keeps it below 32 KiB, so a layer of small blocks would hold
    # it for all of them).
    return lambda data: crc32c(data, 0, 1)


def _blake3() -> Callable[[memoryview], int]:
    blake3 = importlib.import_module("blake3").blake3
    return lambda data: int.from_bytes(blake3(data).digest(DIGEST_BYTES), "little")


def _crc32() -> Callable[[memoryview], int]:
    return zlib.crc32  # releases the GIL above 5 KiB


# Every algorithm this module can run (the benchmark measures them all) ...
ALGORITHMS: dict[str, _Algorithm] = {
    "crc32c": _Algorithm("crc32c", _crc32c),
    "crc32": _Algorithm("", _crc32),
    "xxh3_64": _Algorithm("xxhash", _xxh3_64),
    "blake3": _Algorithm("blake3", _blake3),
}
# ... and what kv_checksum accepts (config.py): see the module docstring.
OFFERED = (NONE, "crc32c", "crc32")


class ChecksumUnavailable(ValueError):
    """The algorithm's library is not installed (or not for this tensor's device)."""


def page_views(
    tensors: Sequence[torch.Tensor | memoryview], page_bytes: int
) -> list[memoryview]:
    """One byte memoryview per ``page_bytes`` of ``tensors`` (contiguous CPU
    tensors or byte memoryviews, of whole pages), no copy; the caller keeps
    the tensors alive while the views are used. One view per underlying storage,
    sliced: a layer message can carry thousands of block views, and a numpy
    view per block would cost about as much as hashing a small block."""
    bases: dict[int, memoryview] = {}
    views: list[memoryview] = []
    for t in tensors:
        size = t.nbytes
        if not size:
            continue
        if isinstance(t, memoryview):
            base, offset = t, 0
        elif not t.is_cpu or not t.is_contiguous():
            raise ValueError("kv_checksum hashes contiguous CPU tensors only")
        else:
            base, offset = storage_view(t, bases)
        if size % page_bytes:
            raise ValueError(
                f"a part of {size} bytes is not whole {page_bytes}-byte blocks"
            )
        views.extend(
            base[o : o + page_bytes] for o in range(offset, offset + size, page_bytes)
        )
    return views


class Checksum:
    """One algorithm: the digests a sender appends, the check a receiver makes."""

    def __init__(self, name: str):
        algorithm = ALGORITHMS.get(name)
        if algorithm is None:
            raise ChecksumUnavailable(
                f"unknown kv_checksum {name!r}; allowed values: {', '.join(OFFERED)}"
            )
        try:
            self._hash = algorithm.make()
        except ImportError:
            raise ChecksumUnavailable(
                f"kv_checksum {name} needs the Python package {algorithm.package!r} "
                f"(pip install {algorithm.package}), which is not installed"
            ) from None
        self.name = name

    def digests(
        self, parts: Sequence[torch.Tensor | memoryview], page_bytes: int
    ) -> torch.Tensor:
        """The digests of every block of ``parts``, in order, as the uint8
        tensor the sender appends to the layer's message."""
        import torch

        values = array.array("Q", map(self._hash, page_views(parts, page_bytes)))
        return torch.frombuffer(values, dtype=torch.uint8)  # keeps ``values`` alive

    def mismatches(
        self, data: torch.Tensor, page_bytes: int, expected: torch.Tensor
    ) -> list[int]:
        """Indices of the blocks of ``data`` whose digest is not the one in
        ``expected`` (as :meth:`digests` made it); empty when all match."""
        got = array.array("Q", map(self._hash, page_views([data], page_bytes)))
        want = expected.numpy().tobytes()
        if got.tobytes() == want:
            return []
        sent = array.array("Q", want)
        if len(sent) != len(got):  # cannot happen: the transport checks sizes
            return list(range(len(got)))
        return [i for i, (a, b) in enumerate(zip(got, sent, strict=True)) if a != b]


def make_checksum(name: str) -> Checksum | None:
    """The checksum ``kv_checksum`` names, or None for ``"none"``; raises
    :class:`ChecksumUnavailable` when its library is missing."""
    return None if name == NONE else Checksum(name)
