"""The router reads the fields the prefill leg does not see as vLLM's
pydantic models do, so a request vLLM refuses is never prefilled; the
fields the prefill leg carries are left to the prefill instance, which
refuses what the decode would refuse before computing anything."""

from __future__ import annotations

import pytest

from vllm_disagg.router.exchange import _PREFILL_DROPPED
from vllm_disagg.router.validation import (
    _INVALID,
    decode_alone_reason,
    lax_bool,
    lax_int,
    streams,
)

BASE = {"model": "m", "prompt": "x", "max_tokens": 4}


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, True),
        (1, True),
        (1.0, True),
        ("yes", True),
        ("TRUE", True),
        ("on", True),
        (False, False),
        (0, False),
        (0.0, False),
        ("no", False),
        ("f", False),
        (" true", _INVALID),
        (2, _INVALID),
        (1.5, _INVALID),
        ("2", _INVALID),
        ([], _INVALID),
        (None, _INVALID),
    ],
)
def test_booleans_as_pydantic_reads_them(value, expected):
    assert lax_bool(value) is expected


@pytest.mark.parametrize(
    "value, expected",
    [
        (5, 5),
        (5.0, 5),
        ("5", 5),
        (" 5", 5),
        ("5.0", 5),
        (True, 1),
        ("-1", -1),
        (5.5, _INVALID),
        ("x", _INVALID),
        ("1e3", _INVALID),
        (None, _INVALID),
        ([5], _INVALID),
    ],
)
def test_integers_as_pydantic_reads_them(value, expected):
    assert (
        lax_int(value) == expected
        if expected is not _INVALID
        else lax_int(value) is _INVALID
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"min_tokens": "x"},
        {"min_tokens": -1},
        {"stream_options": "bad", "stream": True},
        {"stream_options": {"include_usage": True}},
        {"stream_options": {"include_usage": "maybe"}, "stream": True},
        {"stream_options": {"continuous_usage_stats": 2}, "stream": True},
        {"stream_options": {"include_usage": [True]}, "stream": True},
        {"stream_options": ["include_usage"], "stream": True},
        {"max_tokens": -1.0},
        {"max_tokens": 0},
        {"max_tokens": "0"},
        {"max_tokens": 2.5},
        {"min_tokens": "5", "max_tokens": 2},
        {"max_completion_tokens": 0},
        {"stream": " true"},
        {"stream": 2},
        {"best_of": "x"},
        {"use_beam_search": "maybe"},
        {"use_beam_search": "maybe", "n": 2},
    ],
)
def test_what_vllm_refuses_in_fields_the_prefill_leg_does_not_see_goes_to_the_decode(
    fields,
):
    """Each of these was prefilled (its KV pushed into the decode's buffer)
    and only then refused by the decode (an adversarial review's list)."""
    assert decode_alone_reason({**BASE, **fields}) == "invalid"


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"stop": "x"},
        {"stop": ["a", "b"]},
        {"stop_token_ids": [1, "2"]},
        {"stop": None},
        {"min_tokens": "2"},
        {"min_tokens": 4},
        {"max_tokens": 4.0},
        {"max_tokens": None},
        {"stream": "yes", "stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": {"include_usage": "yes", "other": 1}},
        {"stream": True, "stream_options": {"continuous_usage_stats": None}},
        {"stream": True, "stream_options": {}},
        {"stream": 1.0},
        {"include_stop_str_in_output": "true"},
        {"use_beam_search": False},
        {"use_beam_search": "no", "n": 2},
    ],
)
def test_valid_requests_keep_their_prefill_leg(fields):
    assert decode_alone_reason({**BASE, **fields}) is None


@pytest.mark.parametrize(
    "fields",
    [
        {"stop": ""},
        {"stop": ["ok", ""]},
        {"stop": 5},
        {"stop": ["a", 1]},
        {"stop_token_ids": [99999]},
        {"stop_token_ids": "a"},
        {"stop_token_ids": [1, "x"]},
        {"include_stop_str_in_output": "maybe"},
    ],
)
def test_what_the_prefill_leg_carries_is_left_to_the_prefill_instance(fields):
    """The prefill leg carries these (exchange._PREFILL_DROPPED does not
    name them): the prefill instance refuses them in validation, with
    vLLM's own error and its own vocabulary, before computing anything."""
    assert decode_alone_reason({**BASE, **fields}) is None
    assert not set(fields) & set(_PREFILL_DROPPED)


@pytest.mark.parametrize(
    "fields",
    [
        {"use_beam_search": True, "n": 2, "temperature": 0},
        {"use_beam_search": "yes", "n": 3},
        {"use_beam_search": 1},
    ],
)
def test_beam_search_goes_to_the_decode_alone(fields):
    """Beam search in vLLM runs one-token requests of its own that carry no
    kv_transfer_params: a prefill's KV would never be read."""
    assert decode_alone_reason({**BASE, **fields}) == "beam_search"


def test_prompt_logprobs_skip_the_prefill_leg():
    assert decode_alone_reason({**BASE, "prompt_logprobs": 1}) == "prompt_logprobs"
    assert (
        decode_alone_reason({**BASE, "echo": "true", "logprobs": 1})
        == "prompt_logprobs"
    )


def test_streaming_as_vllm_reads_stream():
    assert streams({"stream": 1.0}) and streams({"stream": "Yes"})
    assert (
        not streams({})
        and not streams({"stream": " true"})
        and not streams({"stream": 0})
    )


@pytest.mark.parametrize(
    ("thinking", "max_tokens", "expected"),
    [
        ({"type": "enabled", "budget_tokens": 2048}, 2048, "invalid"),
        ({"type": "enabled", "budget_tokens": 4096}, 1024, "invalid"),
        ({"type": "enabled", "budget_tokens": 1024}, 2048, None),
        ({"type": "disabled"}, 16, None),
        ({"type": "adaptive"}, 16, None),
        ({"type": "enabled", "budget_tokens": "x"}, 16, None),  # vLLM's 400 anyway
    ],
)
def test_a_thinking_budget_vllm_refuses_skips_the_prefill_leg(
    thinking, max_tokens, expected
):
    """On a leg marked do_remote_decode (the one-token prefill leg) vLLM
    skips this check: only the decode would refuse it, after the prefill."""
    body = {"model": "m", "messages": [], "max_tokens": max_tokens}
    body["thinking"] = thinking
    assert decode_alone_reason(body, "/v1/messages") == expected
    assert decode_alone_reason(body, "/v1/chat/completions") is None
