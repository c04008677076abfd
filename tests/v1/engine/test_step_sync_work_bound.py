"""The adaptive look-ahead's bound on the passes a rank's work can still use, on real
vLLM ``Request`` objects (work_bound.py)."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.v1.request import Request

from vllm_disagg.v1.engine.step_sync.work_bound import passes_after_this, passes_for_new


def _request(rid: str, prompt: int, max_tokens: int, computed: int = 0, out: int = 0):
    req = Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens), None)
    req.num_computed_tokens = computed
    for _ in range(out):
        req.append_output_token_ids(7)
    return req


def test_a_decoding_batch_can_use_the_longest_requests_remaining_tokens():
    a = _request("a", 4, 8, computed=6, out=2)  # this pass emits token 3 of 8
    b = _request("b", 4, 3, computed=5, out=1)  # token 2 of 3
    assert passes_after_this([a, b], 0, {"a": 1, "b": 1}) == 5
    assert passes_after_this([b], 0, {"b": 1}) == 1


def test_the_last_token_leaves_no_pass_to_ask_for():
    last = _request("a", 4, 8, computed=11, out=7)
    assert passes_after_this([last], 0, {"a": 1}) == 0


def test_the_final_prompt_chunk_emits_the_first_token():
    req = _request("a", 10, 4, computed=6)
    assert passes_after_this([req], 0, {"a": 4}) == 3


def test_unknown_when_work_waits_a_prompt_is_chunked_or_a_request_sits_out():
    decoding = _request("a", 4, 8, computed=6, out=2)
    chunked = _request("b", 100, 8, computed=0)
    assert passes_after_this([decoding], 1, {"a": 1}) is None  # queued work
    assert passes_after_this([decoding, chunked], 0, {"a": 1, "b": 50}) is None
    assert passes_after_this([decoding, chunked], 0, {"a": 1}) is None  # not scheduled


def test_a_new_request_needs_one_pass_per_output_token_when_its_prompt_fits():
    assert passes_for_new(_request("a", 16, 8), chunk_tokens=2048) == 8
    assert passes_for_new(_request("a", 16, 1), chunk_tokens=2048) == 1
    assert passes_for_new(_request("a", 4096, 8), chunk_tokens=2048) is None
