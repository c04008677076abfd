"""Client side of the OpenAI-compatible API, for tests, examples and benchmarks.

Prompts from one small word list, a completion call, and a streamed
completion read as server-sent events. Each call takes the server as any
object with ``url`` and ``model`` (a ``VllmServer`` of the ``server`` helpers).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import requests

# Every word is a few tokens of the tiny models' tokenizer, so word counts
# give prompts of predictable, varied lengths.
WORDS: tuple[str, ...] = (
    "step",
    "sync",
    "keeps",
    "every",
    "data",
    "parallel",
    "engine",
    "in",
    "lockstep",
    "while",
    "the",
    "proxy",
    "sends",
    "each",
    "request",
    "to",
    "one",
    "prefill",
    "and",
    "one",
    "decode",
    "instance",
    "over",
    "loopback",
)

DEFAULT_TIMEOUT_S = 120.0
SSE_DATA = b"data: "
SSE_DONE = b"data: [DONE]"


class Server(Protocol):
    url: str
    model: str


def random_prompt(rng: random.Random, min_words: int, max_words: int) -> str:
    """A prompt of ``rng.randint(min_words, max_words)`` words drawn from
    :data:`WORDS` (the word count is drawn first)."""
    count = rng.randint(min_words, max_words)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def completions_url(server: Server) -> str:
    return f"{server.url}/v1/completions"


def complete(
    server: Server,
    prompt: str,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **params: Any,
) -> dict:
    """POST /v1/completions; the response body. ``params`` go into the
    request body (``max_tokens=8, temperature=0.0, ...``)."""
    body = {"model": server.model, "prompt": prompt, **params}
    response = requests.post(
        completions_url(server), json=body, headers=headers, timeout=timeout_s
    )
    response.raise_for_status()
    return response.json()


def chat(
    server: Server,
    messages: list[dict],
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **params: Any,
) -> dict:
    """POST /v1/chat/completions; the response body."""
    body = {"model": server.model, "messages": messages, **params}
    url = f"{server.url}/v1/chat/completions"
    response = requests.post(url, json=body, headers=headers, timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def sse_data(lines: Iterable[bytes]) -> Iterator[dict]:
    """The JSON payload of every ``data:`` line of a server-sent event
    stream, skipping other lines and the final ``data: [DONE]``."""
    for line in lines:
        if not line.startswith(SSE_DATA) or line == SSE_DONE:
            continue
        yield json.loads(line[len(SSE_DATA) :])


def stream_completion(
    server: Server,
    prompt: str,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **params: Any,
) -> Iterator[dict]:
    """POST /v1/completions with ``stream: true``; its chunks as they arrive.

    The request is sent at the first ``next()``. Closing the generator (wrap
    it in :func:`contextlib.closing` to stop early) closes the connection,
    which makes the server abort the request.
    """
    body = {"model": server.model, "prompt": prompt, **params, "stream": True}
    url = completions_url(server)
    with requests.post(
        url, json=body, headers=headers, stream=True, timeout=timeout_s
    ) as r:
        r.raise_for_status()
        yield from sse_data(r.iter_lines())


def stream_chat(
    server: Server,
    messages: list[dict],
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **params: Any,
) -> Iterator[dict]:
    """POST /v1/chat/completions with ``stream: true``; its chunks as they arrive."""
    body = {"model": server.model, "messages": messages, **params, "stream": True}
    url = f"{server.url}/v1/chat/completions"
    with requests.post(
        url, json=body, headers=headers, stream=True, timeout=timeout_s
    ) as r:
        r.raise_for_status()
        yield from sse_data(r.iter_lines())


def streamed_text(chunks: Iterable[dict]) -> str:
    """The text of a streamed completion or chat (``text`` or ``delta.content``)."""
    parts = []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            parts.append(
                choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            )
    return "".join(parts)


def token_ids(chunk: dict) -> list[int]:
    """Token ids of one completion chunk (with ``return_token_ids``)."""
    return chunk["choices"][0].get("token_ids") or []
