"""A prefill and a decode of the same architecture and tokenizer with other
weights never answer with a mixture (issue 28).

Before the model fingerprint, the decode continued on the other model's KV:
the layout check passed, the prompt digest (token ids only) matched, and 3 of
3 answers differed from either model's own answer, all HTTP 200. Now the
decode refuses the prefill's channel (``model``) and its prompt digests differ
too, so every answer is the decode model's own (recomputed) answer.
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
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mismatched_pair(tmp_path_factory, start_server):
    out = tmp_path_factory.mktemp("mismatch-models")
    base = build_model("tiny-llama", out)
    tuned = build_model("tiny-llama", out, seed=7, name="tiny-llama-tuned")
    pair = {
        "p": start_instance(start_server, base, "mismatch-p", "kv_producer"),
        "d": start_instance(start_server, tuned, "mismatch-d", "kv_consumer"),
    }
    wait_all(pair)
    return pair


def _own(inst, prompt) -> list[int]:
    """The instance's own greedy answer (no peers named: a plain run)."""
    return ids(
        inst.server.complete(
            prompt, max_tokens=MAX_TOKENS, temperature=0.0, return_token_ids=True
        )
    )


def test_other_weights_are_refused_and_every_answer_is_the_decodes_own(
    mismatched_pair,
):
    p, d = mismatched_pair["p"], mismatched_pair["d"]
    prompts = LENGTH_PROMPTS
    theirs = [_own(p, prompt) for prompt in prompts]
    ours = [_own(d, prompt) for prompt in prompts]
    assert theirs != ours, "the two models must answer differently"
    received_before = metric(d, "vllm:p2p_blocks_received")
    for i, prompt in enumerate(prompts):
        out = disaggregated_completion(
            p, d, prompt, max_tokens=MAX_TOKENS, return_token_ids=True
        )
        assert ids(out) == ours[i], f"prompt {i}: not the decode model's own answer"
    assert metric(d, "vllm:p2p_blocks_received") == received_before
    # The refusal is counted where it happened: the decode refused the Hello.
    assert metric(d, "vllm:p2p_rejected_messages") >= 1
    assert "serves model fingerprint" in d.server.log_text()
