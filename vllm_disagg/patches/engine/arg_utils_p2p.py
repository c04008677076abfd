"""Patch: accept the seed design document's ``--kv-transfer-config`` for
P2pNcclConnector, and check its options at start-up.

Upstream: ``vllm.engine.arg_utils.EngineArgs.add_cli_args``, and
``__post_init__`` / ``create_engine_config`` through the hooks of the
``startup-validation`` enabler (:mod:`.arg_utils`). Registry entry
``p2p-kv-transfer-json`` (feature).

The seed's JSON puts ``"kv_buffer_size":"1e1"`` at the top level, which 0.32's
``KVTransferConfig`` rejects ("kv_buffer_size: Unexpected keyword argument").
The patch wraps ``EngineArgs.add_cli_args`` so the option's argparse ``type``
first runs :func:`normalize_kv_transfer_json` (legacy keys moved into
``kv_connector_extra_config``) and then checks the connector's options, so a
bad value is one argparse error naming the key; the dotted form
(``--kv-transfer-config.kv_buffer_size=1e1``) reaches the same ``type``, as
FlexibleArgumentParser turns it into JSON. A dict given to ``EngineArgs`` is
normalised before upstream's ``__post_init__`` and ``create_engine_config``
see it (:func:`~.arg_utils.add_engine_args_fixup`), and
:func:`check_p2p_config` joins the checks on the built config
(:func:`~.arg_utils.add_config_check`). ``LLM(kv_transfer_config={...})``
converts the dict itself before any plugin has loaded (general plugins load in
``EngineArgs.__post_init__``), so offline users pass
``normalize_kv_transfer_json({...})``.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

from vllm.engine.arg_utils import EngineArgs, _expand_json_human_readable_numbers

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
    CONNECTOR_NAME as P2P_CONNECTOR_NAME,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
    P2pConfig,
    check_p2p_config,
    normalize_kv_transfer_json,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.patches.engine import arg_utils

_upstream_add_cli_args = EngineArgs.add_cli_args

KV_TRANSFER_OPTION = "--kv-transfer-config"


def _load_p2p_json(text: object) -> dict | None:
    """The option's JSON as a dict when it selects P2pNcclConnector, else None
    (then upstream parses the text as it always did)."""
    if not isinstance(text, str):
        return None
    try:
        # Upstream's own pre-pass: bare human-readable numbers ({"x": 80m}).
        obj = json.loads(_expand_json_human_readable_numbers(text))
    except ValueError:
        return None
    if isinstance(obj, dict) and obj.get("kv_connector") == P2P_CONNECTOR_NAME:
        return obj
    return None


def wrap_kv_transfer_type(
    upstream_type: Callable[[str], object],
) -> Callable[[str], object]:
    """The ``--kv-transfer-config`` argparse type, accepting the seed's JSON:
    normalised, parsed by upstream, then the connector's options checked, so
    argparse prints one line naming the key and exits 2."""
    if getattr(upstream_type, "_p2p_kv_transfer_json", False):
        return upstream_type

    @functools.wraps(upstream_type)
    def parse_kv_transfer_config(text: str):
        obj = _load_p2p_json(text)
        if obj is None:
            return upstream_type(text)
        try:
            value = upstream_type(json.dumps(normalize_kv_transfer_json(obj)))
            # Options only: the credentials (local cookie) are found at start.
            P2pConfig.from_kv_transfer_config(value, local_cookie=False)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    parse_kv_transfer_config._p2p_kv_transfer_json = True
    return parse_kv_transfer_config


def _wrap_parser_kv_transfer_type(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if KV_TRANSFER_OPTION in action.option_strings and action.type is not None:
            action.type = wrap_kv_transfer_type(action.type)


def add_cli_args(parser):
    parser = _upstream_add_cli_args(parser)
    _wrap_parser_kv_transfer_type(parser)
    return parser


functools.update_wrapper(add_cli_args, _upstream_add_cli_args)


def normalize_engine_args_kv_transfer(engine_args) -> None:
    """``EngineArgs(kv_transfer_config={...})``: the seed's spelling as a dict."""
    if isinstance(engine_args.kv_transfer_config, dict):
        engine_args.kv_transfer_config = normalize_kv_transfer_json(
            engine_args.kv_transfer_config
        )


def apply() -> None:
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    arg_utils.add_engine_args_fixup(normalize_engine_args_kv_transfer)
    arg_utils.add_config_check(check_p2p_config)


def is_applied() -> bool:
    return (
        EngineArgs.add_cli_args is add_cli_args
        and arg_utils.is_hooked(normalize_engine_args_kv_transfer)
        and arg_utils.is_hooked(check_p2p_config)
    )
