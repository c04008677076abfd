"""Migration's bookkeeping: which requests can move to another (prefill,
decode) pair when their decode fails mid-stream, what the client has been
sent so far, and the continuation's chunks rewritten as the first decode's.

No I/O here (``migrator.py`` opens the continuation): a stream's events go
through :class:`StreamLedger`, which reads the token ids the decode leg was
asked to return (``return_token_ids``), hides them again from a client that
did not ask, and, once a continuation runs, turns its ``/v1/completions``
chunks into the chunks the client's endpoint sends, with the first decode's
``id``, ``created`` and ``model`` and usage counted from the client's prompt.

A continuation is exact (greedy output equal to a colocated run) only where
the next token depends on nothing but the tokens before it and the request's
per-token options; ``migratable.py`` says which requests those are.

The text joins exactly because a continuation starts at a *clean seam*: the
end of a chunk of one token whose text was not empty. vLLM's incremental
detokenizer (``tokenizers``' ``DecodeStream``) sends ``""`` for a token whose
bytes end inside a character and the whole character with the token that
completes it, so after a one-token chunk with text nothing is pending; a
chunk of several tokens (merged when the API server fell behind) or an
empty one may leave bytes pending. Primed with the prompt and the tokens up
to a clean seam, the new decode's detokenizer is where the first one's was;
the tokens after the seam are generated again, and the router sends the
client only what it has not had (their text, their ids), checking that the
rest is what it had. A continuation whose text or visible ids differ from
what the client got ends the stream with an error (``join_failed``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from vllm_disagg.router.migratable import CARRIED, CHAT, token_limit
from vllm_disagg.router.registry import Lease
from vllm_disagg.router.replies import error_json
from vllm_disagg.router.validation import lax_bool, lax_int

SSE_DONE = b"data: [DONE]"
EVENT_END = b"\n\n"
# The largest SSE event a decode may send (its first carries the prompt's
# token ids): beyond it the decode is not speaking vLLM's stream format.
MAX_EVENT_BYTES = 32 << 20
# The most generated tokens a ledger keeps where the request sets no limit;
# beyond it (or beyond the request's own limit, which an honest decode never
# passes) the stream is relayed on but no longer migratable.
MAX_LEDGER_TOKENS = 1 << 20


@dataclass
class Opened:
    """A continuation's decode answering: its lease, response, first bytes."""

    lease: Lease
    resp: aiohttp.ClientResponse
    first: bytes


@dataclass
class Refused:
    """No continuation: the ``outcome`` label and the client's message."""

    outcome: str
    message: str


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events of ``buffer`` (each without its blank line) and
    the incomplete rest."""
    *events, rest = buffer.split(EVENT_END)
    return [e for e in events if e.strip()], rest


def _payload(event: bytes) -> Any:
    if not event.startswith(b"data: "):
        return None
    try:
        return msgspec.json.decode(event[6:])
    except msgspec.DecodeError:
        return None


def _token_ids(value: Any) -> bool:
    """Whether ``value`` is a list of token ids (ints, not bools)."""
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def _malformed(obj: dict[str, Any]) -> str | None:
    """What in a decode's chunk is not vLLM's stream format (None: nothing):
    its token ids would become another pair's prompt, its text the seam."""
    if obj.get("prompt_token_ids") is not None and not _token_ids(
        obj["prompt_token_ids"]
    ):
        return "prompt_token_ids"
    choices = obj.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list):
        return "choices"
    for choice in choices:
        if not isinstance(choice, dict):
            return "choices"
        for name in ("token_ids", "prompt_token_ids"):
            if choice.get(name) is not None and not _token_ids(choice[name]):
                return name
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
        for value in (choice.get("text"), text):
            if value is not None and not isinstance(value, str):
                return "text"
    return None


def _encode(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + EVENT_END


@dataclass
class StreamLedger:
    """One migratable stream: what the client got, and the translation of
    continuations. ``path``: the client's endpoint; ``client_token_ids``:
    the client asked for token ids itself (they stay in its chunks)."""

    body: Mapping[str, Any]
    path: str
    client_token_ids: bool
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False  # [DONE] relayed
    failed: bool = False  # the decode sent an error event
    unmigratable: str | None = None  # found while relaying (``parser``)
    ident: dict[str, Any] = field(default_factory=dict)  # id, created, model
    continuing: bool = False  # the events come from a continuation
    join_failed: str | None = None  # a continuation disagreed with what was sent
    malformed: str | None = None  # a decode broke the stream's format
    _base: int = 0  # tokens generated before the current continuation
    _buffer: bytearray = field(default_factory=bytearray)
    _usage_sent: bool = False
    # A chat's decode sent a token as plain ``content``: a server-side
    # reasoning parser would have shown itself by then (see why_not_resumable).
    _content_seen: bool = False
    # The last clean seam (see the module's docstring): how many generated
    # tokens precede it and the text the client got after it.
    _seam: int = 0
    _text_after_seam: str = ""
    # What the client already has beyond the continuation's position: text
    # and token ids (checked only where it saw them); the continuation
    # repeats them.
    _owed_text: str = ""
    _owed_ids: list[int] = field(default_factory=list)
    # The most generated tokens kept (see _cap_ledger), from the request's
    # limit, read once: the check runs on every chunk.
    _ledger_cap: int = field(init=False, default=MAX_LEDGER_TOKENS)

    def __post_init__(self) -> None:
        limit = token_limit(self.body, self.path)
        if limit is not None:
            self._ledger_cap = min(limit, MAX_LEDGER_TOKENS)

    @property
    def chat(self) -> bool:
        return self.path == CHAT

    def feed(self, data: bytes) -> bytes:
        """What the client is sent for ``data`` read from the decode: whole
        events only, translated; an incomplete one waits for its rest."""
        if self.done:  # [DONE] or an error ended the client's stream
            return b""
        # Only new bytes can end an event: a long one arriving in small
        # pieces is gathered in linear time, and up to MAX_EVENT_BYTES.
        ends = EVENT_END in self._buffer[-1:] + data
        self._buffer += data
        if not ends:
            if len(self._buffer) > MAX_EVENT_BYTES:
                return self._fail_format(f"an event over {MAX_EVENT_BYTES} bytes")
            return b""
        events, rest = split_events(bytes(self._buffer))
        self._buffer = bytearray(rest)
        out = b""
        for e in events:
            out += self._event(e)
            if self.done:
                break
        return out

    def reset_buffer(self) -> None:
        """A failed decode's incomplete event is dropped: its tokens were
        not sent, the continuation computes them again."""
        self._buffer = bytearray()

    def _event(self, event: bytes) -> bytes:
        if event.strip() == SSE_DONE:
            if self.continuing and self.finish_reason is None and not self.failed:
                # A continuation ends only after its last token: this one
                # would end the client's stream short, as if complete.
                return self._fail_format("[DONE] before a finish_reason")
            self.done = True
            return event + EVENT_END
        obj = _payload(event)
        if not isinstance(obj, dict):
            return event + EVENT_END
        if "error" in obj:
            self.failed = True
            return event + EVENT_END
        if (why := _malformed(obj)) is not None:
            return self._fail_format(f"malformed {why}")
        if self.continuing:
            return self._translate(obj)
        return self._observe(obj, event)

    # --- the first decode's events ----------------------------------------

    def _observe(self, obj: dict[str, Any], event: bytes) -> bytes:
        if not self.ident:
            self.ident = {k: obj.get(k) for k in ("id", "created", "model")}
        changed = False
        if self.chat and isinstance(obj.get("prompt_token_ids"), list):
            self.prompt_ids = list(obj["prompt_token_ids"])
            if not self.client_token_ids:
                obj["prompt_token_ids"], changed = None, True
        for choice in obj.get("choices") or ():
            if choice.get("index", 0) != 0:
                self.unmigratable = "n"
                continue
            ids = choice.get("prompt_token_ids")
            if not self.chat and isinstance(ids, list):
                self.prompt_ids = list(ids)
                if not self.client_token_ids:
                    choice["prompt_token_ids"], changed = None, True
            has_tokens = bool(choice.get("token_ids"))
            if isinstance(choice.get("token_ids"), list):
                self.generated.extend(choice["token_ids"])
                self._cap_ledger()
                text = choice.get("text") if not self.chat else None
                if self.chat and isinstance(choice.get("delta"), dict):
                    text = choice["delta"].get("content")
                self._note_seam(len(choice["token_ids"]), text or "", text or "")
                if not self.client_token_ids:
                    choice["token_ids"], changed = None, True
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta")
            if self.chat and isinstance(delta, dict):
                if set(delta) - {"role", "content"} or not delta:
                    self.unmigratable = "parser"
                elif has_tokens and isinstance(delta.get("content"), str):
                    self._content_seen = True
                if (
                    not delta
                    and not self.client_token_ids
                    and choice.get("finish_reason") is None
                    and not choice.get("logprobs")
                ):
                    return b""  # sent only because of return_token_ids
        if obj.get("usage") is not None and not obj.get("choices"):
            self._usage_sent = True
        return _encode(obj) if changed else event + EVENT_END

    def _cap_ledger(self) -> None:
        """A decode that generated more than the request allows (or than
        MAX_LEDGER_TOKENS) is not trusted to be continued, and its ledger
        stops growing: the stream is relayed, not migrated."""
        if len(self.generated) > self._ledger_cap:
            self.unmigratable = "over_limit"
            del self.generated[self._ledger_cap :]

    def _note_seam(self, n_ids: int, raw_text: str, sent_text: str) -> None:
        """Account a chunk of ``n_ids`` tokens whose detokenized text was
        ``raw_text``, of which the client got ``sent_text``."""
        if n_ids == 1 and raw_text:
            self._seam = len(self.generated)
            self._text_after_seam = self._owed_text
        else:
            self._text_after_seam += sent_text

    # --- continuations ------------------------------------------------------

    def why_not_resumable(self) -> str | None:
        """Why the stream cannot continue elsewhere now (None: it can)."""
        if self.unmigratable:
            return self.unmigratable
        if self.failed:
            return "decode_error"
        if self.prompt_ids is None or not self.ident:
            return "no_token_ids"
        if self.chat and not self._content_seen:
            # Nothing says yet whether the server parses reasoning or tool
            # calls out of the text (that shows only in token deltas); a
            # continuation through /v1/completions would send it raw.
            return "before_first_token"
        return None

    def continuation_body(self) -> dict[str, Any]:
        """The ``/v1/completions`` request that goes on from the last clean
        seam: the prompt's and the generated token ids up to it as the
        prompt, what is left of the token limits from there."""
        body: dict[str, Any] = {k: self.body[k] for k in CARRIED if k in self.body}
        assert self.prompt_ids is not None
        kept = self._seam
        body["prompt"] = [*self.prompt_ids, *self.generated[:kept]]
        body["stream"] = True
        body["return_token_ids"] = True
        options = self.body.get("stream_options")
        if isinstance(options, dict):
            body["stream_options"] = dict(options)
        limit = token_limit(self.body, self.path)
        if limit is not None:
            body["max_tokens"] = limit - kept
        min_tokens = self.body.get("min_tokens")
        min_tokens = lax_int(min_tokens) if min_tokens is not None else None
        if isinstance(min_tokens, int) and min_tokens:
            body["min_tokens"] = max(0, min_tokens - kept)
        return body

    def start_continuation(self) -> None:
        """The next events come from a continuation of
        :meth:`continuation_body`: what the client got after the seam is
        owed again by it, and checked."""
        seam = self._seam
        self._owed_ids = [*self.generated[seam:], *self._owed_ids]
        self._owed_text = self._text_after_seam
        del self.generated[seam:]
        self.continuing = True
        self._base = seam
        self._buffer = bytearray()

    def _repeat(self, ids: list[int], text: str) -> tuple[list[int], str] | str:
        """A continuation chunk's ids and text less what the client already
        has, or what disagrees with it (``token ids``, ``text``)."""
        n = min(len(ids), len(self._owed_ids))
        # Ids the client never saw may differ (a sampled stream): only its
        # text must agree then.
        if self.client_token_ids and ids[:n] != self._owed_ids[:n]:
            return "token ids"
        del self._owed_ids[:n]
        owed = self._owed_text
        if owed:
            if text.startswith(owed):
                text, self._owed_text = text[len(owed) :], ""
            elif owed.startswith(text):
                text, self._owed_text = "", owed[len(text) :]
            else:
                return "text"
        return ids[n:], text

    def _fail_join(self, why: str) -> bytes:
        self.join_failed = why
        self.done = True
        return error_events(
            502,
            "the decode instance failed and its continuation on another pair "
            f"did not repeat the {why} the client already had",
        )

    def _fail_format(self, why: str) -> bytes:
        self.malformed = why
        self.done = True
        return error_events(
            502, f"the decode instance broke vLLM's stream format ({why})"
        )

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        usage = dict(usage)
        prompt = len(self.prompt_ids or ())
        completion = self._base + int(usage.get("completion_tokens") or 0)
        usage.update(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
        )
        # The continuation's cached prefix is not the client's prompt's; vLLM's
        # chat usage names the field even when it is empty.
        if self.chat or "prompt_tokens_details" in usage:
            usage["prompt_tokens_details"] = None
        return usage

    def _translate(self, obj: dict[str, Any]) -> bytes:
        """A continuation's ``/v1/completions`` chunk as the client's."""
        out: dict[str, Any] = {
            "id": self.ident["id"],
            "object": "chat.completion.chunk" if self.chat else obj.get("object"),
            "created": self.ident["created"],
            "model": self.ident["model"],
        }
        choices = []
        for choice in obj.get("choices") or ():
            ids = list(choice.get("token_ids") or [])
            raw_text = choice.get("text") or ""
            repeated = self._repeat(ids, raw_text)
            if isinstance(repeated, str):
                return self._fail_join(repeated)
            new_ids, text = repeated
            self.generated.extend(ids)
            self._note_seam(len(ids), raw_text, text)
            finish = choice.get("finish_reason")
            if finish is not None:
                if self._owed_text:
                    return self._fail_join("text")
                if self.client_token_ids and self._owed_ids:
                    return self._fail_join("token ids")
                self.finish_reason = finish
            elif not new_ids and not text and not choice.get("logprobs"):
                continue  # repeats only what the client has
            ids_out = new_ids if self.client_token_ids else None
            if self.chat:
                translated = {
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
                if finish is not None:
                    translated["stop_reason"] = choice.get("stop_reason")
                translated["token_ids"] = ids_out
            else:
                translated = copy.copy(choice)
                translated["index"] = 0
                translated["text"] = text
                if "prompt_token_ids" in translated:
                    translated["prompt_token_ids"] = None
                translated["token_ids"] = ids_out
            choices.append(translated)
        if not choices and obj.get("choices") and obj.get("usage") is None:
            return b""
        out["choices"] = choices
        for key in ("system_fingerprint",):
            if key in obj:
                out[key] = obj[key]
        if obj.get("usage") is not None:
            out["usage"] = self._usage(obj["usage"])
            if not choices:
                self._usage_sent = True
        return _encode(out)

    def closing_events(self) -> bytes | None:
        """The decode failed after the last token (``finish_reason`` sent):
        the usage chunk the client asked for, then ``[DONE]``; None when
        tokens are still owed."""
        if self.finish_reason is None or self.done:
            return None
        out = b""
        options = self.body.get("stream_options")
        if (
            isinstance(options, dict)
            and lax_bool(options.get("include_usage")) is True
            and not self._usage_sent
        ):
            prompt, completion = len(self.prompt_ids or ()), len(self.generated)
            usage = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + completion,
                "completion_tokens": completion,
            }
            out += _encode(
                {
                    "id": self.ident.get("id"),
                    "object": "chat.completion.chunk"
                    if self.chat
                    else "text_completion",
                    "created": self.ident.get("created"),
                    "model": self.ident.get("model"),
                    "choices": [],
                    "usage": usage,
                }
            )
        self.done = True
        return out + SSE_DONE + EVENT_END


def error_events(status: int, message: str) -> bytes:
    """How vLLM ends a stream that failed: its error JSON, then [DONE]."""
    return b"data: " + error_json(status, message) + EVENT_END + SSE_DONE + EVENT_END
