"""Patches: fail at start-up, in one sentence, on configuration errors.

Upstream: ``vllm.engine.arg_utils.EngineArgs.__post_init__`` and
``EngineArgs.create_engine_config``. Two registry entries share this module:

``startup-validation`` (enabler, :func:`apply`), upstream's own options:

* A model given as a filesystem path that does not exist is passed on to the
  Hugging Face Hub client, which on an offline machine fails after retries
  with an error about repository ids, not about the missing directory.
* On the CPU platform, an attention head size the CPU kernel does not
  support is only rejected inside the engine process while the model loads,
  behind several tracebacks.
* On the CPU platform, Ray's executor (``--distributed-executor-backend
  ray``) cannot start workers: it asks Ray for ``resources={"CPU": 1}``,
  which Ray refuses ("Use the 'num_cpus' ... keyword"; before the
  ``cpu-ray-dp`` patch: "current platform cpu does not support ray"). Yet
  upstream picks it by default for ``--data-parallel-backend ray``.

The wrappers check the path before upstream's ``__post_init__`` resolves it
(with ``HF_HUB_OFFLINE=1`` it already asks the Hub client), the executor
backend before upstream's ``create_engine_config`` defaults it (unset with
the Ray DP backend on CPU becomes ``mp``, as the CPU platform already turns
upstream's default ``uni`` into ``mp``; an explicit ``ray`` is refused), and
the head size after upstream builds the config, and raise
:class:`vllm_disagg.errors.ConfigError`.

``step-sync-options`` (feature, :func:`apply_step_sync_options`), this
project's options: adds :func:`check_step_sync_options` to the checks the
``create_engine_config`` wrapper runs on the built config, so a bad
``step_sync_*`` key in ``--additional-config``, or a launch mode step sync
does not support (``--enable-fault-tolerance``), fails there and not in an
engine core. Like every feature it is not applied with
``VLLM_DISAGG_DISABLE=1``, while the enabler stays on.

``p2p-kv-transfer-json`` (feature, :func:`apply_p2p_kv_transfer_json`): the
seed design document's ``--kv-transfer-config`` for ``P2pNcclConnector``
(``"kv_buffer_size":"1e1"`` at the top level) is rejected by 0.32's
``KVTransferConfig`` ("kv_buffer_size: Unexpected keyword argument"). The
patch wraps ``EngineArgs.add_cli_args`` so the option's argparse ``type``
first runs :func:`normalize_kv_transfer_json` (legacy keys moved into
``kv_connector_extra_config``) and then checks the connector's options, so a
bad value is one argparse error naming the key; the dotted form
(``--kv-transfer-config.kv_buffer_size=1e1``) reaches the same ``type``, as
FlexibleArgumentParser turns it into JSON. A dict given to ``EngineArgs``
is normalised before upstream's ``__post_init__`` and ``create_engine_config``
see it, and :func:`check_p2p_config` joins the checks on the built config.
``LLM(kv_transfer_config={...})`` converts the dict itself before any plugin
has loaded (general plugins load in ``EngineArgs.__post_init__``), so offline
users pass ``normalize_kv_transfer_json({...})``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Callable

from vllm.engine.arg_utils import EngineArgs, _expand_json_human_readable_numbers

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config import (
    CONNECTOR_NAME as P2P_CONNECTOR_NAME,
    P2pConfig,
    check_p2p_config,
    normalize_kv_transfer_json,
)
from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger

logger = init_logger(__name__)

_upstream_post_init = EngineArgs.__post_init__
_upstream_create_engine_config = EngineArgs.create_engine_config
_upstream_add_cli_args = EngineArgs.add_cli_args

# Checks of this project's own options, run on the built VllmConfig after
# upstream's; feature patches add theirs (see apply_step_sync_options).
_feature_config_checks: list[Callable[[object], None]] = []
# Fix-ups of this project's own spellings of upstream options, run on the
# EngineArgs before upstream's __post_init__ and create_engine_config (the
# first EngineArgs of a process runs upstream's __post_init__ unwrapped: it
# is what loads the plugins); feature patches add theirs.
_feature_args_fixups: list[Callable[[EngineArgs], None]] = []

KV_TRANSFER_OPTION = "--kv-transfer-config"


def looks_like_local_path(model: str) -> bool:
    """True for values only a filesystem path can mean.

    Hub ids are ``name`` or ``org/name``; anything absolute, starting with
    ``.`` or ``~``, or with more than one ``/`` is a path.
    """
    return (
        os.path.isabs(model)
        or model.startswith((".", "~"))
        or model.count("/") > 1
    )


def check_model_path(model: str) -> None:
    if not isinstance(model, str) or not looks_like_local_path(model):
        return
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ConfigError(f"--model {model!r}: no such file or directory")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"--model {model!r}: directory has no config.json, so it is not a "
            "Hugging Face model directory"
        )


def check_cpu_head_size(vllm_config) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    model_config = vllm_config.model_config
    head_size = model_config.get_head_size()
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ConfigError(
            f"model {model_config.model!r} has attention head size {head_size}, "
            f"which the CPU attention kernel does not support; supported head "
            f"sizes: {', '.join(map(str, supported))}"
        )


def _uses_ray(backend) -> bool:
    return backend == "ray" or bool(getattr(backend, "uses_ray", False))


def check_cpu_executor_backend(engine_args) -> None:
    """On CPU, Ray's executor cannot start workers; resolve the executor
    backend before upstream defaults it.

    Unset with ``--data-parallel-backend ray``, upstream would pick ``ray``
    (a default, not the user's choice): pick ``mp``, as the CPU platform
    already replaces upstream's default ``uni`` by ``mp``. Asked for
    explicitly: refuse, naming the value that works.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    backend = engine_args.distributed_executor_backend
    if backend is None and engine_args.data_parallel_backend == "ray":
        logger.info(
            "CPU platform: --data-parallel-backend ray starts each DP rank's "
            "workers with --distributed-executor-backend mp (Ray's executor "
            "cannot run on CPU)"
        )
        engine_args.distributed_executor_backend = "mp"
    elif _uses_ray(backend):
        raise ConfigError(
            "--distributed-executor-backend ray does not run on the CPU platform "
            "(Ray's executor asks Ray for resources={'CPU': 1}, which Ray refuses); "
            "use --distributed-executor-backend mp, or leave it unset"
        )


def check_step_sync_options(vllm_config) -> None:
    """Step-sync options (--additional-config) fail at start-up, not in an
    engine core: the engine reads them again with the same validation.

    Also refuses launch modes step sync does not support. Fault tolerance
    (--enable-fault-tolerance): vLLM's retry re-forms the DP group after a
    rank fails but not the step-sync group (and needs the
    deepep_low_latency or nixl_ep all2all backend, so never starts on CPU).
    """
    from vllm_disagg.v1.engine.step_sync import StepSyncConfig

    parallel_config = vllm_config.parallel_config
    dp_size = parallel_config.data_parallel_size
    if (
        vllm_config.model_config.is_moe
        and dp_size > 1
        and parallel_config.enable_fault_tolerance
    ):
        raise ConfigError(
            "step sync does not support --enable-fault-tolerance (vLLM's "
            "fault-tolerance retry re-forms the DP group but not the step-sync "
            "group); set VLLM_DISAGG_DISABLE=1 to use upstream DP waves"
        )
    StepSyncConfig.from_additional_config(vllm_config.additional_config, dp_size)


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


def wrap_kv_transfer_type(upstream_type: Callable[[str], object]) -> Callable[[str], object]:
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
            P2pConfig.from_kv_transfer_config(value)
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


@functools.wraps(_upstream_post_init)
def __post_init__(self):
    check_model_path(self.model)
    for fixup in _feature_args_fixups:
        fixup(self)
    _upstream_post_init(self)


@functools.wraps(_upstream_create_engine_config)
def create_engine_config(self, *args, **kwargs):
    check_cpu_executor_backend(self)
    for fixup in _feature_args_fixups:
        fixup(self)
    vllm_config = _upstream_create_engine_config(self, *args, **kwargs)
    check_cpu_head_size(vllm_config)
    for check in _feature_config_checks:
        check(vllm_config)
    return vllm_config


def apply() -> None:
    EngineArgs.__post_init__ = __post_init__
    EngineArgs.create_engine_config = create_engine_config


def is_applied() -> bool:
    return (
        EngineArgs.__post_init__ is __post_init__
        and EngineArgs.create_engine_config is create_engine_config
    )


def apply_step_sync_options() -> None:
    """Feature: validate step-sync options in the wrapper :func:`apply`
    installs (the registry applies enablers first)."""
    if check_step_sync_options not in _feature_config_checks:
        _feature_config_checks.append(check_step_sync_options)


def is_step_sync_options_applied() -> bool:
    return is_applied() and check_step_sync_options in _feature_config_checks


def apply_p2p_kv_transfer_json() -> None:
    """Feature: accept the seed's ``--kv-transfer-config`` JSON for
    P2pNcclConnector and check its options at start-up."""
    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    if normalize_engine_args_kv_transfer not in _feature_args_fixups:
        _feature_args_fixups.append(normalize_engine_args_kv_transfer)
    if check_p2p_config not in _feature_config_checks:
        _feature_config_checks.append(check_p2p_config)


def is_p2p_kv_transfer_json_applied() -> bool:
    return (
        is_applied()
        and EngineArgs.add_cli_args is add_cli_args
        and normalize_engine_args_kv_transfer in _feature_args_fixups
        and check_p2p_config in _feature_config_checks
    )
