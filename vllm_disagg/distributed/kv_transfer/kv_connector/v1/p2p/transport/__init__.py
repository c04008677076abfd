"""Data-plane transports of the P2P KV connector (see :mod:`.base`)."""

from __future__ import annotations

import importlib

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
    TRANSPORTS as TRANSPORT_NAMES,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
    Transport,
    TransportError,
)

# name -> (submodule, class); imported on first use
_CLASSES = {
    "tcp": ("tcp", "TcpTransport"),
    "gloo": ("gloo", "GlooTransport"),
    "nccl": ("nccl", "NcclTransport"),
    "fake": ("fake", "FakeTransport"),
}

__all__ = [
    "TRANSPORT_NAMES",
    "Channel",
    "Transport",
    "TransportError",
    "create_transport",
]


def create_transport(name: str, device: torch.device, bind_host: str) -> Transport:
    """The transport called ``name`` for a worker on ``device``.

    ``auto`` is ``nccl`` on CUDA and ``tcp`` otherwise: on CPU, tcp moved
    KV-block-shaped messages faster than gloo at every size measured by
    ``benchmarks/p2p_transport.py`` (results/p2p_transport.md). Modules are
    imported on demand: nccl and gloo pull in vLLM's device communicators."""
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "tcp"
    if name in _CLASSES:
        module, cls = _CLASSES[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(
            device, bind_host
        )
    raise ValueError(
        f"unknown P2P transport {name!r}; allowed values: {', '.join(TRANSPORT_NAMES)}"
    )
