"""Run ``vllm`` with the Ray DP backend usable on CPU (tests only).

``vllm serve --data-parallel-backend ray`` cannot start on vLLM 0.32's CPU
platform. ``CoreEngineActorManager.create_dp_placement_groups`` counts the
devices of each Ray node under ``current_platform.ray_device_key``, which is
``""`` for ``CpuPlatform`` (only CUDA/ROCm/XPU set ``"GPU"``), and stops with
``AssertionError: No  found in Ray cluster.``

Giving the CPU platform the key ``"CPU"`` is all the DP layer needs: each DP
rank's placement group is then ``world_size`` ``{"CPU": 1}`` bundles plus
upstream's ``{"CPU": 1}`` control bundle that hosts the engine actor. Two
more things a CPU run needs, which are options rather than code:

* ``--distributed-executor-backend mp``: with the Ray DP backend vLLM
  defaults each engine's executor to Ray (``RayExecutorV2``), which asks Ray
  for ``resources={"CPU": 1}`` per worker, and Ray refuses that key
  ("Use the 'num_cpus' and 'num_gpus' keyword instead of 'CPU' and 'GPU'");
* enough logical CPUs in the local Ray cluster that ``vllm serve`` starts:
  ``dp_size * (world_size + 1)``, more than a 2-core machine has. Ray counts
  CPUs logically; ``RAY_OVERRIDE_RESOURCES='{"CPU": 8}'`` raises the count.

This module is the stand-in for an ``enabler`` registry entry (the change is
:func:`apply`); usage: ``python -m vllm_disagg.testing.ray_cpu serve MODEL
--data-parallel-backend ray --distributed-executor-backend mp ...``. Only the
process that launches the engines (the ``vllm serve`` main process) reads the
key when the executor is ``mp``.
"""

from __future__ import annotations

import sys

RAY_DEVICE_KEY = "CPU"


def apply() -> None:
    from vllm.platforms.cpu import CpuPlatform

    if not CpuPlatform.ray_device_key:
        CpuPlatform.ray_device_key = RAY_DEVICE_KEY


def is_applied() -> bool:
    from vllm.platforms.cpu import CpuPlatform

    return CpuPlatform.ray_device_key == RAY_DEVICE_KEY


def main() -> int | None:
    from vllm_disagg.entrypoints.cli.main import main as vllm_main
    from vllm_disagg.patches.entrypoints.cli import main as dist_alias

    dist_alias.apply()  # before vLLM is imported, as the `vllm` script does
    apply()

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
