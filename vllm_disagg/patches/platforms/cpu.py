"""Patch (enabler): give the CPU platform a Ray device key.

Upstream: ``vllm.platforms.cpu.CpuPlatform.ray_device_key``, inherited as
``""`` from ``Platform`` (only CUDA, ROCm and XPU set ``"GPU"``).
``vllm serve --data-parallel-backend ray`` counts the devices of each Ray
node under that key when it creates the DP placement groups
(``CoreEngineActorManager.create_dp_placement_groups``), so on CPU it stops
with ``AssertionError: No  found in Ray cluster.``

With the key ``"CPU"`` each DP rank's placement group is ``world_size``
``{"CPU": 1}`` bundles plus upstream's ``{"CPU": 1}`` bundle for the engine
actor, so the local Ray cluster needs ``dp_size * (world_size + 1)``
logical CPUs. Ray counts the machine's cores; on a small machine raise the
count with ``RAY_OVERRIDE_RESOURCES='{"CPU": 8}'`` (logical only: the
engines still share the real cores).

Each DP rank's workers must be started by the ``mp`` executor: Ray's
executor asks Ray for ``resources={"CPU": 1}`` per worker, which Ray refuses
("Use the 'num_cpus' ... keyword"). That option is resolved at start-up by
the ``startup-validation`` patch (:mod:`vllm_disagg.patches.engine.arg_utils`,
:func:`~vllm_disagg.patches.engine.arg_utils.check_cpu_executor_backend`),
where an explicit ``--distributed-executor-backend`` can be told from
upstream's default.
"""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

RAY_DEVICE_KEY = "CPU"


def apply() -> None:
    if not CpuPlatform.ray_device_key:
        CpuPlatform.ray_device_key = RAY_DEVICE_KEY


def is_applied() -> bool:
    return CpuPlatform.ray_device_key == RAY_DEVICE_KEY
