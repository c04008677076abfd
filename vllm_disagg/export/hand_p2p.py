"""The in-tree form of ``p2p-kv-transfer-json`` beyond the factory line:
``KVTransferConfig`` accepts the connector's documented JSON.

The design document's ``--kv-transfer-config`` puts P2pNcclConnector's
options (``kv_buffer_size``, ``kv_ip``, ``kv_port``, ...) at the top level,
which 0.32's ``KVTransferConfig`` rejects as unexpected keywords. In-tree, a
``mode="before"`` model validator (as ``PoolerConfig`` rejects its removed
parameters) hands a P2pNcclConnector config to the connector's own
normaliser, which moves those keys into ``kv_connector_extra_config`` (and
refuses conflicting ones); any other connector's config is untouched. The
normaliser is imported when used, so the config module does not import the
connector package.
"""

from __future__ import annotations

import libcst as cst

from vllm_disagg.export import cst as anchors
from vllm_disagg.export.edit import Edit

KV_TRANSFER = "vllm/config/kv_transfer.py"

_VALIDATOR = '''\
@model_validator(mode="before")
@classmethod
def _p2p_nccl_top_level_options(cls, data: Any) -> Any:
    """P2pNcclConnector's documented JSON gives its options (kv_buffer_size,
    kv_ip, kv_port, ...) at the top level; the connector reads them from
    kv_connector_extra_config, so they are moved there."""
    values = data.kwargs if isinstance(data, ArgsKwargs) else data
    if not isinstance(values, dict) or values.get("kv_connector") != (
        "P2pNcclConnector"
    ):
        return data
    from vllm.distributed.kv_transfer.kv_connector.v1.p2p.config import (
        normalize_kv_transfer_json,
    )

    normalized = normalize_kv_transfer_json(values)
    if isinstance(data, ArgsKwargs):
        return ArgsKwargs(data.args, normalized)
    return normalized
'''


def _kv_transfer_accepts_p2p_json(module: cst.Module, where: str) -> cst.Module:
    (method,) = anchors.statements(_VALIDATOR)
    method = method.with_changes(leading_lines=[cst.EmptyLine()])
    module = anchors.class_body_insert(
        module, "KVTransferConfig", [method], where, after="compute_hash"
    )
    module = anchors.ensure_import(
        module, "from pydantic import model_validator", where
    )
    return anchors.ensure_import(module, "from pydantic_core import ArgsKwargs", where)


EDITS: tuple[Edit, ...] = (
    Edit(
        "p2p-kv-transfer-json",
        KV_TRANSFER,
        "KVTransferConfig moves P2pNcclConnector's top-level options into "
        "kv_connector_extra_config (a before-validator)",
        _kv_transfer_accepts_p2p_json,
    ),
)
