"""The sender's host byte views of the KV cache (``read_block_bytes``): the
same bytes as the tensor views, one view per run of adjacent blocks, and
no block outside the cache."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine.layout import (
    KVLayout,
)

BLOCKS = 12


def _joined(parts) -> bytes:
    return b"".join(
        bytes(p) if isinstance(p, memoryview) else p.numpy().tobytes() for p in parts
    )


def _layouts():
    dense = torch.randint(0, 1000, (BLOCKS, 2, 4, 8), dtype=torch.int16)
    # K and V of one layer in one tensor, one layer's view per half: each
    # block is contiguous, but the next one is two pages further on.
    both = torch.randint(0, 1000, (BLOCKS, 2, 64), dtype=torch.int32)
    bf16 = torch.randn(BLOCKS, 16, 4).to(torch.bfloat16)
    return {
        "dense": KVLayout({"a": dense, "b": dense.clone()}, 16),
        "strided": KVLayout({"a": both[:, 0], "b": both[:, 1]}, 16),
        "bf16": KVLayout({"a": bf16}, 16),
    }


@pytest.mark.parametrize("name", ["dense", "strided", "bf16"])
def test_byte_views_are_the_blocks_bytes_in_order(name):
    layout = _layouts()[name]
    rng = random.Random(7)
    cases = [[], [0], [BLOCKS - 1], list(range(BLOCKS)), [3, 4, 5, 9, 10, 1, 2]]
    cases += [rng.sample(range(BLOCKS), rng.randint(1, BLOCKS)) for _ in range(20)]
    for ids in cases:
        for layer in range(layout.num_layers):
            got = layout.read_block_bytes(layer, ids)
            assert _joined(got) == _joined(layout.read_blocks(layer, ids))


def test_adjacent_blocks_go_as_one_view_when_the_cache_is_dense():
    layouts = _layouts()
    assert len(layouts["dense"].read_block_bytes(0, [2, 3, 4, 7, 8])) == 2
    assert len(layouts["strided"].read_block_bytes(0, [2, 3, 4])) == 3


@pytest.mark.parametrize("block", [-1, BLOCKS, 10 * BLOCKS])
def test_a_block_outside_the_cache_is_refused(block):
    with pytest.raises(IndexError):
        _layouts()["dense"].read_block_bytes(0, [0, block])


def test_a_cache_of_non_contiguous_blocks_has_no_byte_views():
    kv = torch.zeros(4, BLOCKS, 8).transpose(0, 1)  # block b is not contiguous
    layout = KVLayout({"a": kv}, 16)
    assert not layout.blocks_contiguous
    with pytest.raises(ValueError):
        layout.read_block_bytes(0, [0])
