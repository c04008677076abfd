"""End to end: a DP=2 decode of the tiny MoE (one `vllm serve` per DP rank,
step sync between them) fed by one prefill over the P2P connector.

A rank waiting for remote KV must not stall step sync: while one request on
rank 1 waits for KV that never comes, requests on both ranks complete, and
the waiting one is recomputed after ``kv_load_timeout_s``. Every output
equals a colocated DP=1 run (float32).
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.metadata import make_request_id
from vllm_disagg.testing.openai_client import complete
from vllm_disagg.testing.p2p import (
    P2pInstance,
    disaggregated_completion,
    free_kv_port,
    kv_transfer_config,
)
from vllm_disagg.testing.server import get_free_port

pytestmark = pytest.mark.e2e

COMMON_ARGS = [
    "--max-model-len", "512", "--max-num-seqs", "16", "--seed", "0", "--dtype", "float32",
    "--block-size", "32", "--enforce-eager",
]  # fmt: skip
MAX_TOKENS = 10
LOAD_TIMEOUT_S = 30.0  # the others must finish well before the orphan gives up

_rng = random.Random(7)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(_rng.randint(3, 120))] for _ in range(12)]
ORPHAN = [_rng.randrange(3, 500) for _ in range(70)]


def _ids(response: dict) -> list[int]:
    return list(response["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def reference(tiny_models, start_server):
    server = start_server(tiny_models["tiny-mixtral"], COMMON_ARGS, name="p2p-dp-colocated")
    try:
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(
                lambda p: _ids(server.complete(p, max_tokens=MAX_TOKENS, temperature=0.0,
                                               return_token_ids=True)),
                [*PROMPTS, ORPHAN],
            ))  # fmt: skip
        return {tuple(p): o for p, o in zip([*PROMPTS, ORPHAN], outs)}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def xpyd_dp(tiny_models, start_server, reference):
    model = tiny_models["tiny-mixtral"]
    p_port, d_port, rpc_port = free_kv_port(), free_kv_port(), get_free_port()
    prefill = start_server(
        model,
        [*COMMON_ARGS, "--kv-transfer-config", kv_transfer_config("kv_producer", p_port)],
        name="p2p-dp-prefill", wait=False,
    )  # fmt: skip
    options = json.dumps({"step_sync_peer_timeout_s": 10})
    # One JSON for both ranks: each rank's worker listens on kv_port + dp_rank.
    d_config = kv_transfer_config("kv_consumer", d_port, kv_load_timeout_s=LOAD_TIMEOUT_S)
    decodes = [
        start_server(
            model,
            [
                *COMMON_ARGS,
                "--data-parallel-size", "2",
                "--data-parallel-rank", str(rank),
                "--data-parallel-address", "127.0.0.1",
                "--data-parallel-rpc-port", str(rpc_port),
                "--additional-config", options,
                "--kv-transfer-config", d_config,
            ],  # fmt: skip
            name=f"p2p-dp-decode-rank{rank}",
            wait=False,
        )
        for rank in (0, 1)
    ]
    for server in (prefill, *decodes):
        server.wait_ready()
    yield P2pInstance(prefill, p_port), [P2pInstance(d, d_port + r) for r, d in enumerate(decodes)]
    for server in (prefill, *decodes):
        server.stop()


def test_dp2_decode_loads_remote_kv_and_a_waiting_rank_never_stalls_the_group(xpyd_dp, reference):
    prefill, decodes = xpyd_dp

    # A request on rank 1 whose prefill never happens: it waits for KV.
    orphan_id = make_request_id(prefill.kv_addr, decodes[1].kv_addr)
    with ThreadPoolExecutor(16) as pool:
        started = time.monotonic()
        orphan = pool.submit(
            complete, decodes[1], ORPHAN, headers={"X-Request-Id": orphan_id},
            max_tokens=MAX_TOKENS, temperature=0.0, return_token_ids=True,
        )  # fmt: skip
        time.sleep(0.5)
        # Meanwhile requests on both ranks go through the connector and finish.
        futures = [
            pool.submit(
                disaggregated_completion, prefill, decodes[i % 2], prompt,
                max_tokens=MAX_TOKENS, return_token_ids=True,
            )  # fmt: skip
            for i, prompt in enumerate(PROMPTS)
        ]
        outs = [_ids(f.result(timeout=120)) for f in futures]
        others_done = time.monotonic() - started
        orphan_out = _ids(orphan.result(timeout=120))
        orphan_done = time.monotonic() - started

    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert out == reference[tuple(prompt)], f"request {i} on rank {i % 2}"
    assert orphan_out == reference[tuple(ORPHAN)]
    # The others did not wait for the orphan's deadline; the orphan was recomputed after it.
    assert others_done < orphan_done
    assert orphan_done >= LOAD_TIMEOUT_S - 1
    assert orphan_done < LOAD_TIMEOUT_S + 30
    for d in decodes:
        received = d.server.metrics(prefix="vllm:p2p_bytes_received")
        assert sum(v for labels in received.values() for v in labels.values()) > 0
