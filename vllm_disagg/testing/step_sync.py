"""Step-sync metrics of a running server, per DP rank, for tests and benchmarks."""

from __future__ import annotations

import re

from vllm_disagg.testing.server import VllmServer
from vllm_disagg.v1.metrics.step_sync import PREFIX

_DP_RANK = re.compile(r'dp_rank="(\d+)"')


def step_sync_metric(server: VllmServer, name: str) -> dict[int, float]:
    """One step-sync metric of ``server``'s ``/metrics``, {dp_rank: value}.

    ``name`` is the sample name after the prefix, e.g. ``forward_steps_total``
    (counters) or ``local_step`` (gauges). Empty until the metric is served.
    """
    values = server.metrics(PREFIX).get(f"{PREFIX}{name}", {})
    return {int(_DP_RANK.search(labels).group(1)): v for labels, v in values.items()}
