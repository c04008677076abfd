"""How many more passes a rank's known work can use: the adaptive look-ahead's input.

A rank asks the group for ``lookahead`` passes ahead so that its peers never wait
for a grant; at a drain every pass granted past the last real one is a dummy pass
on every rank. When nothing waits in the scheduler's queues and every running
request is past its prompt, ``max_tokens`` bounds the passes the rank can still
use (a request ends at its length limit or earlier, at EOS or a stop string; a
speculative pass emits one token or more). Asking no further than that bound
costs nothing while work lasts, and a drain that ends at the length limit wastes
no pass.

The bound is an upper bound or None ("unknown"): a queued request, a prompt still
being prefilled in chunks, a running request not scheduled this pass, or a
request without ``max_tokens``. An upper bound can only make the request smaller
than it used to be, never too small: the worst an error here could do is make
a real pass wait for its grant (one round trip), which ``begin_forward`` repairs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol


class _Request(Protocol):
    request_id: str
    num_computed_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int | None


def passes_after_this(
    running: Iterable[_Request],
    num_waiting: int,
    scheduled_tokens: Mapping[str, int],
) -> int | None:
    """The most passes the running requests can use after the pass that schedules
    ``scheduled_tokens`` (request id -> tokens); None when unknown."""
    if num_waiting:
        return None
    most = 0
    for req in running:
        scheduled = scheduled_tokens.get(req.request_id)
        max_tokens = getattr(req, "max_tokens", None)
        if scheduled is None or max_tokens is None:
            return None  # not in this pass, or no length limit: unknown
        if req.num_computed_tokens + scheduled < req.num_prompt_tokens:
            return None  # a prompt chunk: more chunks, then the output
        # This pass emits (at least) one more token of this request.
        most = max(most, max_tokens - req.num_output_tokens - 1)
    return most


def passes_for_new(req: _Request, chunk_tokens: int) -> int | None:
    """The most passes a request just added can use (None when unknown): one for a
    prompt that fits one chunk, then one per further output token."""
    max_tokens = getattr(req, "max_tokens", None)
    if max_tokens is None or req.num_prompt_tokens > chunk_tokens:
        return None
    return max(1, max_tokens - req.num_output_tokens)
