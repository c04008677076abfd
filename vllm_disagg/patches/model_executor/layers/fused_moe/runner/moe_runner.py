"""Patch: on CPU with data parallelism, run the MoE layer behind its custom op.

Upstream:
``vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner._select_forward``
calls the MoE body directly on CPU, so ``torch.compile`` traces it. With
``--data-parallel-size > 1`` that body gathers tokens from every DP rank, and
the gathered length is data-dependent: tracing stops at the first branch on it
(``if M_full == 0`` in the modular kernel) and the engine fails during warm-up.

On GPUs the same body sits behind the opaque ``torch.ops.vllm.moe_forward``
op. This patch picks that op on CPU too, but only when DP > 1; single-rank CPU
keeps upstream's traced path.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.platforms import current_platform

_upstream_select_forward = MoERunner._select_forward


def _select_forward(self: MoERunner):
    if current_platform.is_cpu() and self.moe_config.dp_size > 1:
        if self._shared_experts is None:
            return torch.ops.vllm.moe_forward
        return torch.ops.vllm.moe_forward_shared
    return _upstream_select_forward(self)


def apply() -> None:
    MoERunner._select_forward = _select_forward


def is_applied() -> bool:
    return MoERunner._select_forward is _select_forward
