"""The DP coordinator process, kept for load-balancing stats only."""

from __future__ import annotations

from vllm.v1.engine.coordinator import DPCoordinator


class StatsOnlyDPCoordinator(DPCoordinator):
    """Upstream's DP coordinator with wave coordination always off.

    It still collects request counts from the engines and publishes them to
    the front ends (internal load balancing); it never tracks waves nor sends
    START_DP_WAVE, because step-synchronized engines wake each other.
    """

    def __init__(
        self, parallel_config, enable_wave_coordination: bool = False, **kwargs
    ):
        super().__init__(parallel_config, enable_wave_coordination=False, **kwargs)
