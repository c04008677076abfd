"""Data-plane transports of the P2P KV connector (see :mod:`.base`)."""

from __future__ import annotations

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
    Transport,
    TransportError,
)

TRANSPORT_NAMES = ("auto", "tcp", "gloo", "nccl", "fake")

__all__ = ["TRANSPORT_NAMES", "Channel", "Transport", "TransportError", "create_transport"]


def create_transport(name: str, device: torch.device, bind_host: str) -> Transport:
    """The transport called ``name`` for a worker on ``device``.

    ``auto`` is ``nccl`` on CUDA and ``tcp`` otherwise: on CPU, tcp moved
    KV-block-shaped messages faster than gloo at every size measured by
    ``benchmarks/p2p_transport.py`` (results/p2p_transport.md). Modules are
    imported on demand: nccl and gloo pull in vLLM's device communicators."""
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "tcp"
    if name == "tcp":
        from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.tcp import (
            TcpTransport,
        )

        return TcpTransport(device, bind_host)
    if name == "gloo":
        from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.gloo import (
            GlooTransport,
        )

        return GlooTransport(device, bind_host)
    if name == "nccl":
        from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.nccl import (
            NcclTransport,
        )

        return NcclTransport(device, bind_host)
    if name == "fake":
        from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.fake import (
            FakeTransport,
        )

        return FakeTransport(device, bind_host)
    raise ValueError(
        f"unknown P2P transport {name!r}; allowed values: {', '.join(TRANSPORT_NAMES)}"
    )
