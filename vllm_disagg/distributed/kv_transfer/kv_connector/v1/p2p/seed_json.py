"""The seed design document's ``--kv-transfer-config`` JSON, made acceptable
to vLLM 0.32's ``KVTransferConfig``.

0.32's ``KVTransferConfig`` forbids unknown fields and has no
``kv_buffer_size`` (nor ``kv_ip``, ``kv_rank``, ``kv_parallel_size``), so
:func:`normalize_kv_transfer_json` first moves these legacy top-level keys into
``kv_connector_extra_config`` (the ``p2p-kv-transfer-json`` patch calls it on
the command line's JSON); ``config.P2pConfig`` then reads the result.

* ``kv_rank`` / ``kv_parallel_size`` (the removed V0 ``PyNcclConnector``'s
  static pairing) mean nothing here, peers are named per request: they are
  accepted at the top level, dropped, and warned about once, so old launch
  recipes still start.
* ``kv_load_failure_policy`` defaults to ``"recompute"`` for this connector:
  a lost transfer costs time, never a failed request.
"""

from __future__ import annotations

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.roles import (
    CONNECTOR_NAME,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger
from vllm_disagg.options import parsers

logger = init_logger(__name__)

# Keys the seed document puts at the top level of the JSON that 0.32's
# KVTransferConfig lacks. Moved into kv_connector_extra_config:
MOVED_TOP_LEVEL_KEYS = ("kv_buffer_size", "kv_ip")
# Accepted for old recipes, dropped with a one-time warning:
IGNORED_TOP_LEVEL_KEYS = ("kv_rank", "kv_parallel_size")
LEGACY_TOP_LEVEL_KEYS = MOVED_TOP_LEVEL_KEYS + IGNORED_TOP_LEVEL_KEYS

DEFAULT_KV_LOAD_FAILURE_POLICY = "recompute"

_EXTRA = "kv_connector_extra_config"
_warned: set[str] = set()


def _warn_once(key: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(
            "--kv-transfer-config: %s is ignored by %s (peers are named per "
            "request by the proxy); remove it",
            key,
            CONNECTOR_NAME,
        )


def normalize_kv_transfer_json(obj: dict) -> dict:
    """Make the seed document's JSON acceptable to vLLM 0.32's KVTransferConfig.

    Only for ``kv_connector == "P2pNcclConnector"`` (anything else is returned
    unchanged): returns a copy with :data:`MOVED_TOP_LEVEL_KEYS` moved into
    ``kv_connector_extra_config``, :data:`IGNORED_TOP_LEVEL_KEYS` dropped,
    ``kv_port`` checked and made an int, and ``kv_load_failure_policy``
    defaulted to ``"recompute"``. Raises :class:`ConfigError`.
    """
    if not isinstance(obj, dict) or obj.get("kv_connector") != CONNECTOR_NAME:
        return obj
    out = dict(obj)
    extra = out.get(_EXTRA)
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{_EXTRA}: {parsers.show(extra)} is not a JSON object")
    extra = dict(extra)
    for key in MOVED_TOP_LEVEL_KEYS:
        if key not in out:
            continue
        value = out.pop(key)
        if key in extra and extra[key] != value:
            raise ConfigError(
                f"{key}: given at the top level ({parsers.show(value)}) and in "
                f"{_EXTRA} ({parsers.show(extra[key])}) with different values; give "
                "it once"
            )
        extra[key] = value
    for key in IGNORED_TOP_LEVEL_KEYS:
        if key in out:
            out.pop(key)
            _warn_once(key)
    out[_EXTRA] = extra
    if "kv_port" in out:
        out["kv_port"] = parsers.port("kv_port", out["kv_port"])
    out.setdefault("kv_load_failure_policy", DEFAULT_KV_LOAD_FAILURE_POLICY)
    return out
