"""Patch: step-sync options fail at start-up, not in an engine core.

Upstream: ``vllm.engine.arg_utils.EngineArgs.create_engine_config``, through
the ``startup-validation`` enabler's hook (:mod:`.arg_utils`). Registry entry
``step-sync-options`` (feature): :func:`check_step_sync_options` runs on the
built config, so a bad ``step_sync_*`` key in ``--additional-config``, a
launch mode step sync does not support (``--enable-fault-tolerance``), or
separately started DP ranks beyond loopback without ``VLLM_DISAGG_DP_SECRET``,
is one line at start-up. It also hands the engine cores this process starts a
fresh group secret (``step_sync.credentials.prepare_launch``). Like every
feature it is not applied with ``VLLM_DISAGG_DISABLE=1``, while the enabler
stays on.
"""

from __future__ import annotations

from vllm_disagg.errors import ConfigError
from vllm_disagg.patches.engine import arg_utils
from vllm_disagg.v1.engine.step_sync import StepSyncConfig
from vllm_disagg.v1.engine.step_sync.credentials import prepare_launch


def check_step_sync_options(vllm_config) -> None:
    """Step-sync options (--additional-config) fail at start-up, not in an
    engine core: the engine reads them again with the same validation.

    Also refuses launch modes step sync does not support. Fault tolerance
    (--enable-fault-tolerance): vLLM's retry re-forms the DP group after a
    rank fails but not the step-sync group (and needs the
    deepep_low_latency or nixl_ep all2all backend, so never starts on CPU).

    And prepares the group's secret (credentials.prepare_launch): this
    process runs it on the config before it starts any engine core, so a
    process that starts every rank hands them a fresh secret, and separately
    started ranks without VLLM_DISAGG_DP_SECRET beyond loopback are refused
    here, in one line.
    """
    parallel_config = vllm_config.parallel_config
    dp_size = parallel_config.data_parallel_size
    step_sync = vllm_config.model_config.is_moe and dp_size > 1
    if step_sync and parallel_config.enable_fault_tolerance:
        raise ConfigError(
            "step sync does not support --enable-fault-tolerance (vLLM's "
            "fault-tolerance retry re-forms the DP group but not the step-sync "
            "group); set VLLM_DISAGG_DISABLE=1 to use upstream DP waves"
        )
    StepSyncConfig.from_additional_config(vllm_config.additional_config, dp_size)
    if step_sync:
        # The group's secret: a fresh one for engine cores this process starts
        # itself, or (ranks started separately) the operator's, checked now.
        prepare_launch(parallel_config)


def apply() -> None:
    arg_utils.add_config_check(check_step_sync_options)


def is_applied() -> bool:
    return arg_utils.is_hooked(check_step_sync_options)
