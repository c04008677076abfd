"""Which MoE forward MoERunner._select_forward picks on CPU, with and without DP.

With DP > 1 the tokens gathered from all DP ranks have a data-dependent
count that Dynamo cannot trace, so CPU must call the opaque custom op, as
GPUs always do; a single CPU rank keeps the directly traced function.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.fused_moe.runner import moe_runner
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.cpu_test


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("dp_size", [1, 2])
def test_cpu_select_forward(monkeypatch, dp_size, shared):
    monkeypatch.setattr(moe_runner, "current_platform", CpuPlatform())
    runner = SimpleNamespace(
        moe_config=SimpleNamespace(dp_size=dp_size),
        _shared_experts=object() if shared else None,
    )
    chosen = MoERunner._select_forward(runner)
    if dp_size == 1:
        traced = moe_runner._moe_forward_shared if shared else moe_runner._moe_forward
        assert chosen is traced
    else:
        op = torch.ops.vllm.moe_forward_shared if shared else torch.ops.vllm.moe_forward
        assert chosen is op
