"""Patch: start the DP coordinator process without wave coordination.

Upstream: ``vllm.v1.engine.utils.DPCoordinator``, the name
``launch_core_engines`` instantiates (with ``enable_wave_coordination`` set
for MoE models). Replaced by
:class:`vllm_disagg.v1.engine.coordinator.StatsOnlyDPCoordinator`.
"""

from __future__ import annotations

import vllm.v1.engine.utils as upstream

from vllm_disagg.v1.engine.coordinator import StatsOnlyDPCoordinator


def apply() -> None:
    upstream.DPCoordinator = StatsOnlyDPCoordinator


def is_applied() -> bool:
    return upstream.DPCoordinator is StatsOnlyDPCoordinator
