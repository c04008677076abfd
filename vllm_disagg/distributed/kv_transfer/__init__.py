"""KV connectors this package adds to vLLM, registered through its connector factory."""

from __future__ import annotations

import threading

CONNECTORS = {
    # name users put in --kv-transfer-config -> (module, class)
    "P2pNcclConnector": (
        "vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.connector",
        "P2pNcclConnector",
    ),
}

_lock = threading.Lock()


def register_connectors() -> list[str]:
    """Register every connector with vLLM's factory; idempotent.

    The factory raises on a duplicate name, and vLLM resolves the connector
    name in every process (the API server too), so each process registers
    once, from the plugin entry point. A name that is already taken by
    someone else is left alone.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registered = []
    with _lock:
        for name, (module, cls) in CONNECTORS.items():
            if name in KVConnectorFactory._registry:
                continue
            KVConnectorFactory.register_connector(name, module, cls)
            registered.append(name)
    return registered


__all__ = ["CONNECTORS", "register_connectors"]
