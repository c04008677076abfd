"""``kv_checksum`` end to end: a prefill and a decode that both check every KV
block answer as a colocated run does, with the KV over the connector.

The engine tests (test_engine_checksum.py) cover corruption, refusals and
the byte counts; this one covers the option's way from the JSON through the
worker into both engines.
"""

from __future__ import annotations

import pytest

from vllm_disagg.testing.p2p import disaggregated_completion
from vllm_disagg.testing.tiny_models import build_model

from .e2e_common import (
    LENGTH_PROMPTS,
    MAX_TOKENS,
    ids,
    metric,
    start_instance,
    wait_all,
    wait_metric,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def checked_pair(tmp_path_factory, start_server):
    model = build_model("tiny-llama", tmp_path_factory.mktemp("checksum-model"))
    pair = {
        "p": start_instance(
            start_server, model, "checksum-p", "kv_producer", kv_checksum="crc32c"
        ),
        "d": start_instance(
            start_server, model, "checksum-d", "kv_consumer", kv_checksum="crc32c"
        ),
    }
    wait_all(pair)
    return pair


def test_checked_transfers_answer_as_a_colocated_run(checked_pair):
    p, d = checked_pair["p"], checked_pair["d"]
    received = metric(d, "vllm:p2p_blocks_received")
    outs = [
        ids(
            disaggregated_completion(
                p, d, prompt, max_tokens=MAX_TOKENS, return_token_ids=True
            )
        )
        for prompt in LENGTH_PROMPTS
    ]
    for i, prompt in enumerate(LENGTH_PROMPTS):
        # The prefill's own answer (no peers named: a plain run) is the
        # colocated one; asked after, so the decode's cache had no prefix hit.
        own = ids(
            p.server.complete(
                prompt, max_tokens=MAX_TOKENS, temperature=0.0, return_token_ids=True
            )
        )
        assert outs[i] == own, f"prompt {i}: differs from the colocated answer"
    # The KV came over the connector, checked, and nothing failed.
    assert wait_metric(d, "vllm:p2p_blocks_received", received + 1) > received
    assert metric(d, "vllm:p2p_checksum_mismatches") == 0
    assert metric(d, "vllm:p2p_failed_loads") == 0
    assert metric(d, "vllm:p2p_rejected_messages") == 0
    for inst in (p, d):
        assert "kv_checksum crc32c" in inst.server.log_text()
