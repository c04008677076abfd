"""P2P KV transfer connector (``P2pNcclConnector``) for xPyD disaggregation.

The public surface, as vLLM's ``nixl/__init__.py`` lists its connector's: the
connector, its scheduler and worker sides, the per-step metadata, the options
and the stats. The names are imported on first use (as vLLM's own
``__init__`` does): importing the package imports nothing of vLLM, and
importing one submodule (``p2p.config``, say) does not import the connector
and the engine behind it. See docs/p2p_connector.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
        P2pConfig,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.connector import (
        P2pNcclConnector,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.extra_config import (
        SendType,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import (
        LoadSpec,
        P2pConnectorMetadata,
        SaveSpec,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.scheduler import (
        P2pSchedulerConnector,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.stats import (
        P2pKVConnectorStats,
        P2pPromMetrics,
    )
    from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.worker import (
        P2pWorkerConnector,
    )

# public name -> the submodule that defines it
_SOURCES = {
    "LoadSpec": "metadata",
    "P2pConfig": "config",
    "P2pConnectorMetadata": "metadata",
    "P2pKVConnectorStats": "stats",
    "P2pNcclConnector": "connector",
    "P2pPromMetrics": "stats",
    "P2pSchedulerConnector": "scheduler",
    "P2pWorkerConnector": "worker",
    "SaveSpec": "metadata",
    "SendType": "extra_config",
}

__all__ = [
    "LoadSpec",
    "P2pConfig",
    "P2pConnectorMetadata",
    "P2pKVConnectorStats",
    "P2pNcclConnector",
    "P2pPromMetrics",
    "P2pSchedulerConnector",
    "P2pWorkerConnector",
    "SaveSpec",
    "SendType",
]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{source}"), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
