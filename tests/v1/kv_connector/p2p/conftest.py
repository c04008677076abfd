"""The ``make_engine`` fixture of test_engine.py and test_engine_safety.py."""

from __future__ import annotations

import pytest
import torch

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.engine import (
    KVLayout,
    P2pEngine,
)
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.transport import (
    create_transport,
)
from vllm_disagg.testing.server import get_free_port

from .test_engine import BLOCK_SHAPE, BLOCK_SIZE, BLOCKS, HOST, LAYERS, Node


@pytest.fixture
def make_engine():
    nodes: list[Node] = []

    def make(
        transport: str = "fake",
        send_type: str = "PUT_ASYNC",
        *,
        buf: int = 1 << 26,
        pool: int = 0,
        hold: float = 5.0,
        secret: bytes | None = None,
        layers: int = LAYERS,
        shape: tuple[int, ...] = BLOCK_SHAPE,
        dtype: torch.dtype = torch.float32,
        block_size: int = BLOCK_SIZE,
        seed: int = 0,
        checksum: str = "none",
    ) -> Node:
        gen = torch.Generator().manual_seed(seed)
        kv = {
            f"model.layers.{i}.self_attn.attn": torch.randn(
                BLOCKS, *shape, generator=gen
            ).to(dtype)
            for i in range(layers)
        }
        for attempt in range(5):
            try:
                engine = P2pEngine(
                    layout=KVLayout(kv, block_size),
                    host=HOST,
                    port=get_free_port(),
                    transport=create_transport(transport, torch.device("cpu"), HOST),
                    send_type=send_type,
                    kv_buffer_size=buf,
                    mem_pool_size_bytes=pool,
                    hold_timeout_s=hold,
                    secret=secret,
                    checksum=checksum,
                )
                break
            except OSError:  # the free port was taken in between
                if attempt == 4:
                    raise
        node = Node(engine, kv)
        nodes.append(node)
        return node

    try:
        yield make
    finally:
        for node in nodes:
            node.engine.close()
