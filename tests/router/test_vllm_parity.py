"""The router's copy of vLLM's request validation stays vLLM's: its
``StreamOptions`` is vLLM's model field for field, and for every body below
the router sends to the decode alone as "invalid" exactly what vLLM's own
request models refuse (the other fields are the prefill instance's to
refuse: the prefill leg carries them).

The only router tests that import vLLM (about 7 s on an idle 2-core
machine): the router itself never does.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_disagg.router import validation
from vllm_disagg.router.exchange import _PREFILL_DROPPED

protocol = pytest.importorskip("vllm.entrypoints.generate.base.protocol")
completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
exceptions = pytest.importorskip("vllm.exceptions")

REQUESTS = {
    "completion": (completion.CompletionRequest, {"prompt": "x"}),
    "chat": (
        chat.ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x"}]},
    ),
}


def test_stream_options_is_vllms_model():
    ours, theirs = validation.StreamOptions, protocol.StreamOptions
    assert ours.model_config.get("extra") == theirs.model_config.get("extra")
    assert ours.model_fields.keys() == theirs.model_fields.keys()
    for name, field in theirs.model_fields.items():
        mine = ours.model_fields[name]
        assert (mine.annotation, mine.default) == (field.annotation, field.default)
    for request, _ in REQUESTS.values():
        assert request.model_fields["stream_options"].annotation == (
            protocol.StreamOptions | None
        )


@pytest.mark.parametrize("endpoint", list(REQUESTS))
@pytest.mark.parametrize(
    "fields",
    [
        {"stream": True, "stream_options": {"include_usage": "maybe"}},
        {"stream": True, "stream_options": {"continuous_usage_stats": 2}},
        {"stream": True, "stream_options": {"include_usage": [True]}},
        {"stream": True, "stream_options": ["include_usage"]},
        {"stream": True, "stream_options": "include_usage"},
        {"stream": False, "stream_options": {"include_usage": True}},
        {"stream_options": {"include_usage": True}},
        {"stream": "yes", "stream_options": {"include_usage": "on"}},
        {"stream": True, "stream_options": {"include_usage": "yes", "x": 1}},
        {"stream": True, "stream_options": {"continuous_usage_stats": None}},
        {"stream": True, "stream_options": {}},
        {"stream": True, "stream_options": None},
        {"stream": 2},
        {"stream": " true"},
        {"use_beam_search": "maybe"},
        {"use_beam_search": "yes", "n": 2},
    ],
)
def test_invalid_as_vllms_request_models_say(endpoint, fields):
    request, base = REQUESTS[endpoint]
    try:
        request.model_validate({**base, **fields})
        refused = False
    # pydantic's ValidationError, or vLLM's own from a "before" validator:
    # both are vLLM's 400.
    except (ValueError, exceptions.VLLMValidationError):
        refused = True
    assert (validation.decode_alone_reason({**base, **fields}) == "invalid") is (
        refused
    ), fields


@pytest.mark.parametrize("endpoint", list(REQUESTS))
def test_the_prefill_leg_carries_the_stop_options(endpoint):
    """What vLLM checks with the tokenizer (stop_token_ids against the
    vocabulary) or in SamplingParams (empty stop strings) only an instance
    can check: the prefill leg carries those fields."""
    request, _ = REQUESTS[endpoint]
    for name in ("stop", "stop_token_ids", "include_stop_str_in_output"):
        assert name in request.model_fields and name not in _PREFILL_DROPPED


@pytest.mark.parametrize("endpoint", list(REQUESTS))
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"max_tokens": 63},
        {"max_tokens": 64},
        {"max_tokens": 65},
        {"max_tokens": "65"},
        {"max_tokens": 65.0},
        {"max_tokens": None},
        {"max_completion_tokens": 65},
        {"max_completion_tokens": 64, "max_tokens": 65},
        {"max_completion_tokens": 65, "max_tokens": 64},
        {"max_completion_tokens": None, "max_tokens": 65},
        {"max_tokens": 0},
    ],
)
def test_over_context_as_vllms_request_models_say(endpoint, fields):
    """``validation.over_context`` is the check of vLLM's ``build_tok_params``
    (output limit against ``max_model_len``), field for field."""
    request, base = REQUESTS[endpoint]
    body = {**base, **fields}
    try:
        parsed = request.model_validate(body)
    except (ValueError, exceptions.VLLMValidationError):
        pytest.skip("vLLM's request model refuses the body before the check")
    try:
        parsed.build_tok_params(SimpleNamespace(max_model_len=64))
        refused = False
    except exceptions.VLLMValidationError:
        refused = True
    path = "/v1/completions" if endpoint == "completion" else "/v1/chat/completions"
    assert validation.over_context(body, path, 64) is refused, fields
    assert validation.over_context(body, path, 0) is False  # not known: never
