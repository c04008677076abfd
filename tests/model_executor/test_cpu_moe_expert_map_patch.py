"""The cpu-moe-expert-map enabler, called directly: route mapping, every CPU
experts class wrapped once, and the exported commit's own test (partial
outputs of expert-parallel ranks sum to the full layer) on the plugin form."""

from __future__ import annotations

import runpy

import pytest
import torch

from vllm_disagg.export.tree import UPSTREAM_TESTS
from vllm_disagg.patches.model_executor.layers.fused_moe.experts import (
    cpu_moe as patch,
)

EXPORTED = UPSTREAM_TESTS / "tests/model_executor/test_cpu_moe_expert_map.py"


def test_routes_to_other_ranks_get_a_valid_slot_and_no_weight():
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    ids = torch.tensor([[2, 0], [1, 0], [3, 2]], dtype=torch.int32)
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.5, 0.5]])
    local, kept, remote_rows = patch._local_expert_routes(ids, weights, expert_map)
    assert local.dtype == ids.dtype
    assert local.tolist() == [[0, 0], [0, 0], [1, 0]]
    assert kept.tolist() == [[0.75, 0.0], [0.0, 0.0], [0.5, 0.5]]
    assert remote_rows.tolist() == [False, True, False]


def test_all_local_routes_are_only_renumbered():
    expert_map = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    ids = torch.tensor([[2, 3]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4]])
    local, kept, remote_rows = patch._local_expert_routes(ids, weights, expert_map)
    assert local.tolist() == [[0, 1]] and kept is weights and remote_rows is None


def test_apply_wraps_each_experts_class_once():
    patch.apply()
    patch.apply()
    assert patch.is_applied()
    for cls in patch._experts_classes():
        inner = cls.apply.__wrapped__
        assert not getattr(inner, patch._WRAPPED, False), cls.__name__


@pytest.mark.parametrize(
    "name",
    [
        "test_expert_parallel_ranks_sum_to_the_full_layer",
        "test_router_weight_on_input_rows_routed_elsewhere_add_nothing",
    ],
)
def test_the_exported_commit_test_passes_on_the_plugin_form(name):
    patch.apply()
    exported = runpy.run_path(str(EXPORTED))
    if name == "test_expert_parallel_ranks_sum_to_the_full_layer":
        for ep_size in (2, 4):
            for topk in (1, 2):
                exported[name](ep_size, topk)
    else:
        exported[name]()
