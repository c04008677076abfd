"""Patch: fail at start-up, in one sentence, on configuration errors.

Upstream: ``vllm.engine.arg_utils.EngineArgs.__post_init__`` and
``EngineArgs.create_engine_config``. Registry entry ``startup-validation``
(enabler, :func:`apply`), upstream's own options:

* A model given as a filesystem path that does not exist is passed on to the
  Hugging Face Hub client, which on an offline machine fails after retries
  with an error about repository ids, not about the missing directory.
  Object-store URIs (``s3://``, ``gs://``, ``az://``) are not paths: they are
  left to upstream, as are Hub ids and the tokenizer.
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

Features check their own options in the same wrappers through two hooks,
:func:`add_engine_args_fixup` and :func:`add_config_check`, from their own
modules (``arg_utils_step_sync.py``, ``arg_utils_p2p.py``): this enabler is
always on, so it imports no feature; with ``VLLM_DISAGG_DISABLE=1`` the
features' patches do not run and no hook is added.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from vllm.engine.arg_utils import EngineArgs
from vllm.transformers_utils.utils import is_cloud_storage

from vllm_disagg.errors import ConfigError
from vllm_disagg.logger import init_logger

logger = init_logger(__name__)

_upstream_post_init = EngineArgs.__post_init__
_upstream_create_engine_config = EngineArgs.create_engine_config

# Checks of this project's own options, run on the built VllmConfig after
# upstream's (add_config_check).
_feature_config_checks: list[Callable[[object], None]] = []
# Fix-ups of this project's own spellings of upstream options, run on the
# EngineArgs before upstream's __post_init__ and create_engine_config (the
# first EngineArgs of a process runs upstream's __post_init__ unwrapped: it
# is what loads the plugins); add_engine_args_fixup.
_feature_args_fixups: list[Callable[[EngineArgs], None]] = []


def add_config_check(check: Callable[[object], None]) -> None:
    """For features: run ``check(vllm_config)`` on every config
    ``create_engine_config`` builds; it raises ConfigError. Idempotent."""
    if check not in _feature_config_checks:
        _feature_config_checks.append(check)


def add_engine_args_fixup(fixup: Callable[[EngineArgs], None]) -> None:
    """For features: run ``fixup(engine_args)`` before upstream's
    ``__post_init__`` and ``create_engine_config``. Idempotent."""
    if fixup not in _feature_args_fixups:
        _feature_args_fixups.append(fixup)


def is_hooked(hook: Callable) -> bool:
    """Whether a feature's check or fix-up is in place (its ``is_applied``)."""
    return is_applied() and (
        hook in _feature_config_checks or hook in _feature_args_fixups
    )


def looks_like_local_path(model: str) -> bool:
    """True for values only a filesystem path can mean.

    Hub ids are ``name`` or ``org/name``; anything absolute, starting with
    ``.`` or ``~``, or with more than one ``/`` is a path, except what vLLM
    itself resolves without the filesystem: object-store URIs (``s3://``,
    ``gs://``, ``az://``; vLLM's own ``is_cloud_storage``, the test upstream's
    ``__post_init__`` uses to keep them from the Hub path look-up before
    ``ModelConfig`` pulls them through the Run:ai streamer).
    """
    if is_cloud_storage(model):
        return False
    return os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1


def check_model_path(model: str) -> None:
    """Refuse, in one line, a ``--model`` that names a local path that is not
    there (or a directory that is not a Hugging Face model); leave alone Hub
    ids and everything vLLM resolves without the filesystem."""
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
    # The kernels also dispatch 48, which upstream's list leaves out (its
    # in-tree form adds it there): a head size of 48 runs, so accept it.
    supported = sorted({*CPUAttentionBackend.get_supported_head_sizes(), 48})
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
