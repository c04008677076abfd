"""The CPU MoE experts under expert parallelism: each rank holds some experts
and gets global expert ids; the ranks' partial outputs must sum to the output
of one rank holding every expert (what the MoE combine step adds up)."""

from types import SimpleNamespace

import pytest
import torch

from vllm._custom_ops import cpu_prepack_moe_weight
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
    CPUUnquantizedExperts,
)

pytestmark = pytest.mark.cpu_test

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOKENS = 4, 64, 64, 7


def _run(w13, w2, topk_ids, topk_weights, expert_map, hidden, on_input=False):
    experts = SimpleNamespace(
        isa=CPUUnquantizedExperts.isa,
        _use_zentorch=False,
        w1_bias=None,
        w2_bias=None,
    )
    output = torch.zeros_like(hidden)
    CPUUnquantizedExperts.apply(
        experts,
        output=output,
        hidden_states=hidden,
        w1=cpu_prepack_moe_weight(w13, experts.isa),
        w2=cpu_prepack_moe_weight(w2, experts.isa),
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        activation=MoEActivation.SILU,
        global_num_experts=NUM_EXPERTS,
        expert_map=expert_map,
        a1q_scale=None,
        a2_scale=None,
        workspace13=None,
        workspace2=None,
        expert_tokens_meta=None,
        apply_router_weight_on_input=on_input,
    )
    return output


@pytest.mark.parametrize("ep_size", [2, 4])
@pytest.mark.parametrize("topk", [1, 2])
def test_expert_parallel_ranks_sum_to_the_full_layer(ep_size, topk):
    torch.manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE) / INTERMEDIATE**0.5
    hidden = torch.randn(TOKENS, HIDDEN)
    topk_ids = torch.stack(
        [torch.randperm(NUM_EXPERTS)[:topk] for _ in range(TOKENS)]
    ).to(torch.int32)
    topk_weights = torch.rand(TOKENS, topk)
    full = _run(w13, w2, topk_ids, topk_weights, None, hidden)

    per_rank = NUM_EXPERTS // ep_size
    total = torch.zeros_like(full)
    for rank in range(ep_size):
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
        expert_map[mine] = torch.arange(per_rank, dtype=torch.int32)
        total += _run(
            w13[mine].contiguous(),
            w2[mine].contiguous(),
            topk_ids,
            topk_weights,
            expert_map,
            hidden,
        )
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def test_router_weight_on_input_rows_routed_elsewhere_add_nothing():
    torch.manual_seed(1)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE) / INTERMEDIATE**0.5
    hidden = torch.randn(TOKENS, HIDDEN)
    topk_ids = torch.tensor([[e % NUM_EXPERTS] for e in range(TOKENS)]).to(torch.int32)
    ones = torch.ones(TOKENS, 1)
    full = _run(w13, w2, topk_ids, ones, None, hidden, on_input=True)
    expert_map = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    local = _run(w13[:2].contiguous(), w2[:2].contiguous(), topk_ids, ones,
                 expert_map, hidden, on_input=True)
    here = topk_ids[:, 0] < 2
    torch.testing.assert_close(local[here], full[here], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(local[~here]) == 0
