"""End to end, GET and PUT: real prefill and decode `vllm serve` instances on
the tiny Llama, one pair per mode, driven as the design document's proxy
drives them. Decode's greedy token ids (float32) equal a colocated run and its
metrics show the KV came over the connector; in GET mode decode pulls only the
blocks its own prefix cache lacks; a dead prefill costs one recompute within
``kv_load_timeout_s``.

The colocated reference is the PUT prefill instance answering requests that
name no peers, before it takes part in any transfer. PUT_ASYNC, the router and
the host pool are in test_p2p_e2e.py.
"""

from __future__ import annotations

import time

import pytest

from vllm_disagg.testing.openai_client import complete
from vllm_disagg.testing.p2p import disaggregated_completion, peer_naming

from .e2e_common import (
    BLOCK_SIZE,
    LENGTH_PROMPTS,
    LOAD_TIMEOUT_S,
    MANY_PROMPTS,
    MAX_TOKENS,
    check_lengths,
    colocated_reference,
    ids,
    key,
    metric,
    start_instance,
    wait_all,
    wait_metric,
)

pytestmark = pytest.mark.e2e

# The first starts with the two-block shared prefix, the second shares it.
PREFIX_PROMPTS = (MANY_PROMPTS[0], MANY_PROMPTS[3])


@pytest.fixture(scope="module")
def get_put_set(tiny_models, start_server):
    model = tiny_models["tiny-llama"]
    common = {"kv_load_timeout_s": LOAD_TIMEOUT_S}

    def start(name, role, send_type):
        return start_instance(
            start_server, model, name, role, send_type=send_type, **common
        )

    instances = {
        "p_get": start("p2p-get-p", "kv_producer", "GET"),
        "d_get": start("p2p-get-d", "kv_consumer", "GET"),
        "p_put": start("p2p-put-p", "kv_producer", "PUT"),
        "d_put": start("p2p-put-d", "kv_consumer", "PUT"),
    }
    wait_all(instances)
    yield instances
    for inst in instances.values():
        inst.server.stop()


@pytest.fixture(scope="module")
def reference(get_put_set) -> dict:
    return colocated_reference(get_put_set["p_put"], [*LENGTH_PROMPTS, *PREFIX_PROMPTS])


@pytest.mark.parametrize("mode", ["get", "put"])
def test_get_and_put_every_prompt_length_equals_colocated(get_put_set, reference, mode):
    p, d = get_put_set[f"p_{mode}"], get_put_set[f"d_{mode}"]
    check_lengths(p, d, reference)
    assert wait_metric(d, "vllm:p2p_bytes_received", 1) > 0
    assert metric(d, "vllm:p2p_failed_loads") == 0


def test_get_pulls_only_blocks_missing_from_the_decode_prefix_cache(
    get_put_set, reference
):
    p, d = get_put_set["p_get"], get_put_set["d_get"]
    first, other = PREFIX_PROMPTS
    assert other[: 2 * BLOCK_SIZE] == first[: 2 * BLOCK_SIZE]
    disaggregated_completion(p, d, first, max_tokens=2, return_token_ids=True)
    blocks_before = wait_metric(d, "vllm:p2p_blocks_received", 1)
    # Same shared prefix, a different tail: decode holds the first two blocks itself.
    out = disaggregated_completion(
        p, d, other, max_tokens=MAX_TOKENS, return_token_ids=True
    )
    assert ids(out) == reference[key(other)]
    expected = -(-len(other) // BLOCK_SIZE) - 2
    received = (
        wait_metric(d, "vllm:p2p_blocks_received", blocks_before + expected)
        - blocks_before
    )
    assert received == expected
    assert metric(d, "vllm:p2p_failed_loads") == 0


def test_a_dead_prefill_costs_a_recompute_within_the_deadline(get_put_set, reference):
    p, d = get_put_set["p_get"], get_put_set["d_get"]
    p.server.kill()
    prompt = LENGTH_PROMPTS[2]
    # The prefill is gone, so only the decode half of the proxy flow runs.
    start = time.monotonic()
    headers, params = peer_naming(p.kv_addr, d.kv_addr)
    out = complete(
        d,
        prompt,
        headers=headers,
        **params,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        return_token_ids=True,
    )
    elapsed = time.monotonic() - start
    assert ids(out) == reference[key(prompt)]
    assert elapsed < LOAD_TIMEOUT_S + 10
    assert wait_metric(d, "vllm:p2p_failed_loads", 1) >= 1
