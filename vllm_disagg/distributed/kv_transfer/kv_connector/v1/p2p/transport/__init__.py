"""Data-plane transports of the P2P KV connector (see :mod:`.base`)."""

from __future__ import annotations

import importlib

import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.extra_config import (
    TRANSPORTS as TRANSPORT_NAMES,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import (
    Channel,
    Transport,
    TransportError,
)
from vllm_disagg.errors import ConfigError

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


def create_transport(
    name: str,
    device: torch.device,
    bind_host: str,
    *,
    advertise_host: str | None = None,
    data_port: int = 0,
) -> Transport:
    """The transport called ``name`` for a worker on ``device``.

    ``auto`` is ``nccl`` on CUDA and ``tcp`` otherwise: on CPU, tcp moved
    KV-block-shaped messages faster than gloo at every size measured by
    ``benchmarks/p2p_transport.py`` (results/p2p_transport.md). Modules are
    imported on demand: nccl and gloo pull in vLLM's device communicators.

    ``advertise_host`` (what peers are told, when not ``bind_host``) and
    ``data_port`` (0: a free one) are the tcp transport's (``kv_bind_ip``,
    ``kv_data_port``); the others advertise where they bind."""
    if name == "auto":
        name = "nccl" if device.type == "cuda" else "tcp"
    if name not in _CLASSES:
        raise ValueError(
            f"unknown P2P transport {name!r}; allowed values: "
            f"{', '.join(TRANSPORT_NAMES)}"
        )
    module, cls = _CLASSES[name]
    factory = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    if name == "tcp":
        return factory(
            device, bind_host, advertise_host=advertise_host, data_port=data_port
        )
    if data_port or (advertise_host not in (None, bind_host)):
        raise ConfigError(
            "kv_connector_extra_config.kv_bind_ip, kv_data_port: a bind address "
            f"other than kv_ip and a fixed data port need the tcp transport; this "
            f"worker's is {name} (transport auto on {device.type}): set transport "
            "to tcp or drop them"
        )
    return factory(device, bind_host)
