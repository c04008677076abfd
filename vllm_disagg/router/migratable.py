"""Which requests may move to another (prefill, decode) pair mid-stream.

The option tables of migration: what a continuation carries unchanged (each
option acts on the next token alone), what only shapes the prompt, which
values are as if absent, and why any other value is refused (the ``reason``
label of the not-migratable counter). Unknown options are refused: fail
closed. Apart from the stream ledger (``migration.py``) because this answers
one question about a request body before anything is sent, and grows with
every option vLLM adds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_disagg.router.validation import lax_int

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MIGRATED_PATHS = (COMPLETIONS, CHAT)

# Options a continuation carries unchanged: they act on each next token alone.
CARRIED = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "priority",
    "cache_salt",
    "user",
    "kv_transfer_params",
)
# Options that only shape the prompt (its token ids are what the decode
# returns) or that the continuation sets itself.
PROMPT_ONLY = (
    "prompt",
    "messages",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "truncate_prompt_tokens",
    "reasoning_effort",
    "stream",
    "stream_options",
    "return_token_ids",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "request_id",
    "return_tokens_as_token_ids",
    "parallel_tool_calls",
    "tool_choice",
)
# An option set to one of these values is as if absent.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "stop": (None, "", []),
    "seed": (None,),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "bad_words": (None, []),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
}
# Why a non-neutral value is not migrated: the ``reason`` label.
_REASONS = {
    "n": "n",
    "best_of": "n",
    "echo": "echo",
    "logprobs": "logprobs",
    "top_logprobs": "logprobs",
    "prompt_logprobs": "logprobs",
    "stop": "stop",  # matched on text that would be split at the seam
    "seed": "seed",  # the sampler's generator state does not move
    "presence_penalty": "penalties",  # counted over output tokens only
    "frequency_penalty": "penalties",
    "repetition_penalty": "penalties",
    "bad_words": "bad_words",  # multi-token words span the seam
    "tools": "tools",  # parsed over the whole output
    "response_format": "structured_output",  # the grammar restarts
    "structured_outputs": "structured_output",
    "use_beam_search": "n",
    "length_penalty": "n",
}
NOT_MIGRATABLE_REASONS = (
    *sorted(set(_REASONS.values())),
    "prompts",  # several prompts in one completion request
    "multimodal",  # the prompt's placeholders need the media again
    "parser",  # the decode parsed reasoning or tool calls out of the text
    "over_limit",  # the decode sent more tokens than the request's limit
    "before_first_token",  # a chat whose decode sent no token: parser unknown
    "option",  # an option not known to be exact: fail closed
)


def not_migratable_reason(body: Mapping[str, Any], path: str) -> str | None:
    """Why ``body`` cannot be continued exactly on another pair (a metric
    label), or None. Unknown options count as not exact."""
    if path not in MIGRATED_PATHS:
        return "option"
    for name, value in body.items():
        if name in CARRIED or name in PROMPT_ONLY:
            continue
        neutral = _NEUTRAL.get(name)
        if neutral is None:
            return "option"
        if value is not None and not any(
            type(value) is type(v) and value == v for v in neutral
        ):
            return _REASONS[name]
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if (
            isinstance(prompt, list)
            and len(prompt) > 1
            and isinstance(prompt[0], str | list)
        ):
            return "prompts"
    else:
        for message in body.get("messages") or ():
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(
                not isinstance(p, dict) or p.get("type") != "text" for p in content
            ):
                return "multimodal"
    return None


def token_limit(body: Mapping[str, Any], path: str) -> int | None:
    """The request's output token limit as vLLM reads it (None: the model's
    length is the limit)."""
    value = body.get("max_tokens")
    if path == CHAT and body.get("max_completion_tokens") is not None:
        value = body["max_completion_tokens"]
    # Read as vLLM's pydantic models read it: "20" and 20.0 are 20.
    value = lax_int(value) if value is not None else None
    return value if isinstance(value, int) else None
