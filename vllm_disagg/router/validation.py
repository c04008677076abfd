"""What the router must know of vLLM's request validation.

The prefill leg carries every field of the client's body that vLLM
validates, but for those a one-token, unstreamed pass cannot carry (see
``exchange._PREFILL_DROPPED``): the prefill instance validates the rest
exactly as the decode would (stop strings, stop token ids against its
vocabulary, logprobs, ``n``, ...) and answers vLLM's own 400 before
computing anything. Of the fields it does not carry, a request vLLM would
refuse goes to the decode alone, which refuses it in validation, before any
compute, with vLLM's own error. ``stream_options`` is checked with a copy of
vLLM's own pydantic model (``StreamOptions``; a test holds it equal to
vLLM's); the numbers and flags are read the way vLLM's pydantic models read
them (lax mode: ``"5"`` and ``5.0`` are 5, ``"yes"`` and ``1.0`` are true,
``" true"`` and ``2`` are not booleans). When in doubt the answer is
"invalid": a decode that accepts after all answers correctly by itself,
only without a prefill instance's help.

Beam search goes to the decode alone too: vLLM runs it as a series of
one-token requests of its own, which carry none of the client's
``kv_transfer_params``, so a prefill's KV would never be read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_RE = re.compile(r"[+-]?[0-9]+(\.0*)?")
_INVALID = object()


def lax_bool(value: Any) -> Any:
    """Pydantic's lax bool: True/False, or _INVALID."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return {0: False, 1: True}.get(value, _INVALID)  # 1.0 == 1
    if isinstance(value, str):
        text = value.lower()
        return True if text in _TRUE else False if text in _FALSE else _INVALID
    return _INVALID


def lax_int(value: Any) -> Any:
    """Pydantic's lax int: an int, or _INVALID."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else _INVALID
    if isinstance(value, str) and _INT_RE.fullmatch(text := value.strip()):
        return int(float(text)) if "." in text else int(text)
    return _INVALID


class StreamOptions(BaseModel):
    """vLLM's ``StreamOptions`` (its OpenAI request models' type of
    ``stream_options``): the same fields, types and defaults, extra keys
    allowed as in every vLLM request model."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def valid_stream_options(value: Any) -> bool:
    """Whether vLLM's request models take ``value`` as ``stream_options``."""
    if value is None:
        return True
    try:
        StreamOptions.model_validate(value)
    except ValidationError:
        return False
    return True


def streams(body: Mapping[str, Any]) -> bool:
    """Whether vLLM streams the answer to ``body``."""
    return lax_bool(body.get("stream")) is True


def _optional(body: Mapping[str, Any], name: str, check) -> bool:
    """Whether ``body[name]`` is absent, null, or passes ``check``."""
    value = body.get(name)
    return value is None or check(value)


def _thinking_over_budget(body: Mapping[str, Any]) -> bool:
    """Whether vLLM's Messages check refuses ``body``: enabled thinking whose
    budget_tokens is not below max_tokens (other shapes are for its request
    model to refuse)."""
    thinking = body.get("thinking")
    if not isinstance(thinking, Mapping) or thinking.get("type") != "enabled":
        return False
    raw_budget, raw_limit = thinking.get("budget_tokens"), body.get("max_tokens")
    if raw_budget is None or raw_limit is None:
        return False
    budget, limit = lax_int(raw_budget), lax_int(raw_limit)
    return budget is not _INVALID and limit is not _INVALID and budget >= limit


def decode_alone_reason(
    body: Mapping[str, Any], path: str = "/v1/completions"
) -> str | None:
    """Why ``body`` goes to the decode alone, with no prefill leg (a
    ``decode_prefill_fallbacks`` label), or None.

    * ``prompt_logprobs``: vLLM computes the whole prompt where it must
      return prompt logprobs (it reads no cached or transferred KV), so a
      prefill elsewhere would be work and buffer space for nothing.
    * ``invalid``: vLLM would refuse something the prefill leg cannot show.
    * ``beam_search``: vLLM's beam search reads no transferred KV (its
      one-token requests carry no ``kv_transfer_params``).
    * ``stored_response``: a ``/v1/responses`` request that continues a
      stored response or conversation: its prompt is the stored history,
      which only the decode holding it can render.

    ``path`` names the request model: ``/v1/responses`` limits tokens with
    ``max_output_tokens``, ``/inference/v1/generate`` keeps its sampling
    options in ``sampling_params``.
    """
    if path == "/v1/responses":
        if body.get("previous_response_id") is not None or (
            body.get("conversation") is not None
        ):
            return "stored_response"
        body = {k: v for k, v in body.items() if k not in ("max_tokens", "min_tokens")}
        if body.get("max_output_tokens") is not None:
            body["max_tokens"] = body["max_output_tokens"]
    elif path == "/v1/messages" and _thinking_over_budget(body):
        # vLLM skips this check on a leg marked do_remote_decode (the
        # one-token prefill leg), so only the decode would refuse it.
        return "invalid"
    elif path == "/inference/v1/generate":
        sampling = body.get("sampling_params")
        if sampling is None:
            sampling = {}
        if not isinstance(sampling, Mapping):
            return "invalid"
        body = {**sampling, "stream": body.get("stream")}
    if body.get("prompt_logprobs") is not None or (
        lax_bool(body.get("echo")) is True and body.get("logprobs") is not None
    ):
        return "prompt_logprobs"
    limit_name = (
        "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    )
    limit = lax_int(body[limit_name]) if body.get(limit_name) is not None else None
    low = lax_int(body["min_tokens"]) if body.get("min_tokens") is not None else None
    valid = (
        limit is not _INVALID
        and (limit is None or limit >= 1)
        and low is not _INVALID
        and (low is None or low >= 0)
        and (low is None or limit is None or low <= limit)
        and _optional(body, "stream", lambda v: lax_bool(v) is not _INVALID)
        and valid_stream_options(body.get("stream_options"))
        # vLLM's own test (a "before" validator): the raw values, not coerced.
        and not (body.get("stream_options") and not body.get("stream"))
        and _optional(body, "best_of", lambda v: lax_int(v) is not _INVALID)
        and _optional(body, "use_beam_search", lambda v: lax_bool(v) is not _INVALID)
    )
    if not valid:
        return "invalid"
    if lax_bool(body.get("use_beam_search")) is True:
        return "beam_search"
    return None


def output_limit(body: Mapping[str, Any], path: str) -> int | None:
    """The output-token limit vLLM checks against ``--max-model-len`` for
    ``body`` at ``path`` (its request models' ``build_tok_params``), or None
    where it checks none or the value is not an int (its model refuses
    that itself)."""
    if path == "/inference/v1/generate":
        return None  # a token-in API: vLLM checks no output limit there
    if path == "/v1/responses":
        raw = body.get("max_output_tokens")
    elif path == "/v1/completions" or (
        path == "/invocations" and "messages" not in body
    ):
        raw = body.get("max_tokens")
    else:  # chat's request model; /v1/messages becomes a chat request
        raw = body.get("max_completion_tokens")
        if raw is None:
            raw = body.get("max_tokens")
    limit = lax_int(raw) if raw is not None else None
    return limit if isinstance(limit, int) else None


def over_context(body: Mapping[str, Any], path: str, max_model_len: int) -> bool:
    """Whether vLLM refuses ``body`` because its output limit alone is
    larger than ``max_model_len`` (0: not known, never). The prefill leg asks
    for one token, so only the decode would refuse it: after the prefill."""
    limit = output_limit(body, path)
    return max_model_len > 0 and limit is not None and limit > max_model_len
