"""What the router must know of vLLM's request validation.

The prefill leg sees a one-token, unstreamed copy of the body without the
client's stop and streaming options (see ``proxy._PREFILL_DROPPED``), so it
cannot refuse what vLLM would refuse in those fields. A request whose
dropped fields vLLM would refuse goes to the decode alone, which refuses it
in validation, before any compute, with vLLM's own error. The checks read
values the way vLLM's pydantic models do (lax mode: ``"5"`` and ``5.0`` are
5, ``"yes"`` and ``1.0`` are true, ``" true"`` and ``2`` are not booleans),
and when in doubt say "invalid": a decode that accepts after all answers
correctly by itself, only without a prefill instance's help.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

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


def streams(body: Mapping[str, Any]) -> bool:
    """Whether vLLM streams the answer to ``body``."""
    return lax_bool(body.get("stream")) is True


def _optional(body: Mapping[str, Any], name: str, check) -> bool:
    """Whether ``body[name]`` is absent, null, or passes ``check``."""
    value = body.get(name)
    return value is None or check(value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def decode_alone_reason(body: Mapping[str, Any]) -> str | None:
    """Why ``body`` goes to the decode alone, with no prefill leg (a
    ``decode_prefill_fallbacks`` label), or None.

    * ``prompt_logprobs``: vLLM computes the whole prompt where it must
      return prompt logprobs (it reads no cached or transferred KV), so a
      prefill elsewhere would be work and buffer space for nothing.
    * ``invalid``: vLLM would refuse something the prefill leg cannot show.
    """
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
        and _optional(body, "stream_options", lambda v: isinstance(v, dict))
        # vLLM's own test (a "before" validator): the raw values, not coerced.
        and not (body.get("stream_options") and not body.get("stream"))
        and _optional(body, "stop", lambda v: isinstance(v, str) or _is_str_list(v))
        and _optional(
            body,
            "stop_token_ids",
            lambda v: isinstance(v, list)
            and all(lax_int(i) is not _INVALID for i in v),
        )
        and _optional(
            body, "include_stop_str_in_output", lambda v: lax_bool(v) is not _INVALID
        )
        and _optional(body, "best_of", lambda v: lax_int(v) is not _INVALID)
        and _optional(body, "use_beam_search", lambda v: lax_bool(v) is not _INVALID)
    )
    return None if valid else "invalid"
