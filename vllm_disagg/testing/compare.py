"""Compare two runs: greedy completions the way vLLM's own tests do, and two
HTTP servers' answers to the same requests, field by field."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests


@dataclass
class GreedyResult:
    """Token ids of one greedy completion, with the top-k logprobs per position."""

    token_ids: list[int]
    top_logprobs: list[dict[int, float]]

    @classmethod
    def from_completion(cls, choice: dict) -> GreedyResult:
        """Build from an OpenAI completions choice made with
        ``return_token_ids=True`` and ``logprobs=k``."""
        token_ids = list(choice["token_ids"])
        top = []
        logprobs = choice.get("logprobs") or {}
        for entry in logprobs.get("top_logprobs") or []:
            top.append({_token_id(tok): lp for tok, lp in (entry or {}).items()})
        return cls(token_ids, top)


def _token_id(token: str) -> int:
    # With return_tokens_as_token_ids the keys are "token_id:<n>".
    return int(token.rsplit(":", 1)[1])


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def close_by_logprobs(a: GreedyResult, b: GreedyResult) -> tuple[bool, str]:
    """Upstream vLLM's ``check_logprobs_close`` rule: identical, or at the first
    differing position each side's token is in the other's top-k."""
    pos = first_difference(a.token_ids, b.token_ids)
    if pos is None:
        return True, "identical"
    if pos >= len(a.token_ids) or pos >= len(b.token_ids):
        return False, f"lengths differ ({len(a.token_ids)} vs {len(b.token_ids)})"
    ta, tb = a.token_ids[pos], b.token_ids[pos]
    ok = ta in b.top_logprobs[pos] and tb in a.top_logprobs[pos]
    return ok, f"first difference at {pos}: {ta} vs {tb}"


# --- two HTTP servers asked the same thing, compared field by field ----------------
#
# ``compare_servers(a_url, b_url, cases, rules)`` sends every :class:`HttpCase`
# to both servers and turns each answer into a *view*: status, media type, a
# few headers, and the body as JSON, as text, or for a server-sent event
# stream its JSON events merged into one object (text, token ids and logprobs
# of each choice concatenated) and whether it ended with ``data: [DONE]``.
# :func:`differences` walks two views together and lists every field path
# where they differ: a key on one side only, another value, another type.
# Fields that differ by nature (``id``, ``created``...) are compared through
# :class:`FieldRules` normalizers; :func:`split_known` sets apart the
# differences a table of known ones covers.


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()  # the value of a field one side does not have
SSE_DONE = "[DONE]"
SSE_EVENTS = "sse_events"  # a view's key of a stream's events as they came


@dataclass(frozen=True)
class HttpCase:
    """One request: JSON ``body`` (or ``raw`` bytes as they are), ``headers``
    added to the default ``Content-Type: application/json``; ``exact``: names
    of normally normalized fields (see :class:`FieldRules`) this case compares
    as they are (``{"id"}`` when the client sent ``X-Request-Id``)."""

    name: str
    path: str = "/v1/completions"
    body: Any = None
    method: str = "POST"
    raw: bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    exact: frozenset[str] = frozenset()


@dataclass(frozen=True)
class FieldRules:
    """How two views are compared. ``normalize``: field name -> function both
    sides' values go through before they are compared, wherever that key
    appears in a JSON object; ``float_rel_tol``: floats this close are equal;
    ``headers``: response headers (lower case) that are part of the view."""

    normalize: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    float_rel_tol: float = 0.0
    headers: tuple[str, ...] = ("x-request-id",)


@dataclass(frozen=True)
class FieldDifference:
    path: str  # "status", "body.error.param", "stream.merged.choices[1].text"
    a: Any
    b: Any


# The rules when none are given: the defaults of every field.
DEFAULT_RULES = FieldRules()


def id_shape(value: Any) -> Any:
    """An id with its random part masked: ``cmpl-<hex>``, ``chatcmpl-<hex>``.
    What is not random (a prefix, a client's id, an address) stays."""
    return (
        re.sub(r"[0-9a-fA-F]{8,}", "<hex>", value) if isinstance(value, str) else value
    )


def type_name(value: Any) -> str:
    """Only the type of a value counts (timestamps)."""
    return type(value).__name__


def send(
    base_url: str,
    case: HttpCase,
    timeout_s: float = 60.0,
    keep_headers: Iterable[str] = (),
) -> dict[str, Any]:
    """Send ``case`` to ``base_url``; the answer's view (see :func:`answer_view`),
    or ``{"exception": ...}`` when no answer came."""
    headers = {"Content-Type": "application/json", **case.headers}
    data = case.raw
    if data is None and case.body is not None:
        data = json.dumps(case.body).encode()
    try:
        response = requests.request(
            case.method,
            base_url + case.path,
            data=data,
            headers=headers,
            timeout=timeout_s,
        )
    except requests.RequestException as e:
        return {"exception": type(e).__name__}
    return answer_view(
        response.status_code, response.headers, response.content, keep_headers
    )


def media_type(content_type: str | None) -> str | None:
    """``text/event-stream; charset=utf-8`` -> ``text/event-stream``."""
    if content_type is None:
        return None
    return content_type.split(";", 1)[0].strip().lower()


def answer_view(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    keep_headers: Iterable[str] = (),
) -> dict[str, Any]:
    """``{"status", "content_type", "headers", and "body" or "stream"}``: JSON
    bodies decoded, event streams as :func:`stream_view` (and their events
    under ``SSE_EVENTS``), other bodies as text."""
    lower = {k.lower(): v for k, v in headers.items()}
    view: dict[str, Any] = {
        "status": status,
        "content_type": media_type(lower.get("content-type")),
        "headers": {h: lower[h] for h in keep_headers if h in lower},
    }
    text = body.decode("utf-8", errors="replace")
    if view["content_type"] == "text/event-stream":
        events = parse_sse(text)
        view["stream"] = stream_view(events)
        view[SSE_EVENTS] = events  # for people: not compared
        return view
    try:
        view["body"] = json.loads(text) if text else ""
    except ValueError:
        view["body"] = text
    return view


def parse_sse(text: str) -> list[Any]:
    """The events of a server-sent event stream: each ``data:`` payload as
    JSON, ``"[DONE]"`` as itself, anything else (``event:`` fields, text that
    is no JSON) as ``{"<unparsed>": text}``."""
    events: list[Any] = []
    for block in re.split(r"\r?\n\r?\n", text):
        # Empty lines and comments (":...") carry nothing.
        lines = [line for line in re.split(r"\r?\n", block) if line and line[0] != ":"]
        if not lines:
            continue
        data = [
            line[5:].removeprefix(" ") for line in lines if line.startswith("data:")
        ]
        if len(data) != len(lines):
            events.append({"<unparsed>": block})
            continue
        payload = "\n".join(data)
        if payload == SSE_DONE:
            events.append(SSE_DONE)
            continue
        try:
            events.append(json.loads(payload))
        except ValueError:
            events.append({"<unparsed>": payload})
    return events


def stream_view(events: list[Any]) -> dict[str, Any]:
    """What a stream says, whatever its grouping into events: the events
    merged (:func:`merge_events`), and ``done``: it ended with one ``[DONE]``.

    How many tokens one event carries is timing: vLLM merges the outputs a
    request's queue holds when its event is written (a busy API server sends
    fewer, larger events), so two servers, or one server twice, group the
    same stream differently. The events themselves are in ``sse_events``."""
    return {
        "merged": merge_events(events),
        "done": bool(events) and events[-1] == SSE_DONE and events.count(SSE_DONE) == 1,
    }


def merge_events(events: Iterable[Any]) -> dict[str, Any]:
    """The JSON events of a stream as one object: each top-level field's last
    value that is not null (``usage``: the final count), ``choices`` merged
    by ``index`` (:func:`merge_chunks`: text, ``delta.content``, token ids and
    logprobs concatenated), sorted by index; non-object events (an unparsed
    line) listed under ``"<other>"``."""
    merged: dict[str, Any] = {}
    choices: dict[Any, Any] = {}
    for event in events:
        if event == SSE_DONE:
            continue
        if not isinstance(event, dict) or "<unparsed>" in event:
            merged.setdefault("<other>", []).append(event)
            continue
        for key, value in event.items():
            if key == "choices" and isinstance(value, list):
                merged.setdefault("choices", [])
                for choice in value:
                    index = choice.get("index") if isinstance(choice, dict) else None
                    choices[index] = merge_chunks(choices.get(index), choice)
            elif value is not None or key not in merged:
                merged[key] = value
    if "choices" in merged:
        merged["choices"] = [choices[i] for i in sorted(choices, key=repr)]
    return merged


def merge_chunks(old: Any, new: Any) -> Any:
    """One choice's chunks as one: strings and lists concatenated, objects
    merged key by key, null never overwrites, other values: the last."""
    if old is None:
        return new
    if new is None:
        return old
    if isinstance(old, str) and isinstance(new, str):
        return old + new
    if isinstance(old, list) and isinstance(new, list):
        return old + new
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [*old, *(k for k in new if k not in old)]
        return {k: merge_chunks(old.get(k), new.get(k)) for k in keys}
    return new


def differences(
    a: Any,
    b: Any,
    rules: FieldRules = DEFAULT_RULES,
    exact: Iterable[str] = (),
    path: str = "",
) -> list[FieldDifference]:
    """Every field path where ``a`` and ``b`` differ (JSON-like values)."""
    out: list[FieldDifference] = []
    _walk(a, b, path, rules, frozenset(exact), out)
    return out


def _walk(
    a: Any,
    b: Any,
    path: str,
    rules: FieldRules,
    exact: frozenset[str],
    out: list[FieldDifference],
) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            sub = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                out.append(FieldDifference(sub, a.get(k, ABSENT), b.get(k, ABSENT)))
                continue
            va, vb = a[k], b[k]
            normalize = rules.normalize.get(k) if k not in exact else None
            if normalize is not None:
                va, vb = normalize(va), normalize(vb)
            _walk(va, vb, sub, rules, exact, out)
    elif isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            sub = f"{path}[{i}]"
            if i >= len(a) or i >= len(b):
                out.append(
                    FieldDifference(
                        sub,
                        a[i] if i < len(a) else ABSENT,
                        b[i] if i < len(b) else ABSENT,
                    )
                )
            else:
                _walk(a[i], b[i], sub, rules, exact, out)
    elif type(a) is float and type(b) is float and rules.float_rel_tol:
        if not math.isclose(a, b, rel_tol=rules.float_rel_tol):
            out.append(FieldDifference(path, a, b))
    elif type(a) is not type(b) or a != b:
        out.append(FieldDifference(path, a, b))


def compare_servers(
    a_url: str,
    b_url: str,
    cases: Sequence[HttpCase],
    rules: FieldRules = DEFAULT_RULES,
    timeout_s: float = 60.0,
) -> tuple[dict[str, list[FieldDifference]], dict[str, tuple[Any, Any]]]:
    """Each case sent to both servers at once (cases one after the other);
    (differences by case name, the two views by case name)."""
    assert len({c.name for c in cases}) == len(cases), "case names must be unique"
    diffs: dict[str, list[FieldDifference]] = {}
    views: dict[str, tuple[Any, Any]] = {}
    with ThreadPoolExecutor(2) as pool:
        for case in cases:
            fa = pool.submit(send, a_url, case, timeout_s, rules.headers)
            fb = pool.submit(send, b_url, case, timeout_s, rules.headers)
            va, vb = fa.result(), fb.result()
            views[case.name] = (va, vb)
            compared = [
                {k: v for k, v in view.items() if k != SSE_EVENTS} for view in (va, vb)
            ]
            diffs[case.name] = differences(*compared, rules, case.exact)
    return diffs, views


# Known differences: case name -> (field path patterns, reason). A pattern
# matches a path and everything under it; ``*`` stands for any characters but
# ``.`` (``stream.events[*].id``, ``body.data[*].root``; ``*`` alone: all).


def path_matches(pattern: str, path: str) -> bool:
    regex = re.escape(pattern).replace(r"\*", r"[^.]*")
    return re.fullmatch(rf"{regex}(?:[.\[].*)?", path) is not None


def split_known(
    diffs: Mapping[str, list[FieldDifference]],
    known: Mapping[str, tuple[Sequence[str], str]],
) -> tuple[dict[str, list[FieldDifference]], dict[str, list[str]]]:
    """(the differences no known pattern covers, by case; the known patterns
    that matched nothing, by case: stale entries)."""
    unexpected: dict[str, list[FieldDifference]] = {}
    stale: dict[str, list[str]] = {}
    for name in sorted(known.keys() - diffs.keys()):
        stale[name] = ["<no such case>"]
    for name, found in diffs.items():
        patterns = known.get(name, ((), ""))[0]
        left = [d for d in found if not any(path_matches(p, d.path) for p in patterns)]
        if left:
            unexpected[name] = left
        unused = [
            p for p in patterns if not any(path_matches(p, d.path) for d in found)
        ]
        if unused:
            stale[name] = unused
    return unexpected, stale


def _short(value: Any, width: int) -> str:
    text = (
        value
        if value is ABSENT
        else json.dumps(value, ensure_ascii=False, default=repr)
    )
    text = str(text)
    return text if len(text) <= width else text[: width - 3] + "..."


def format_differences(
    diffs: Mapping[str, list[FieldDifference]],
    a_name: str = "a",
    b_name: str = "b",
    per_case: int = 8,
    width: int = 100,
) -> str:
    """One line per difference (at most ``per_case`` per case):
    ``case: path: a_name=... b_name=...``."""
    lines = []
    for name, found in diffs.items():
        for d in found[:per_case]:
            lines.append(
                f"{name}: {d.path}: {a_name}={_short(d.a, width)} "
                f"{b_name}={_short(d.b, width)}"
            )
        if len(found) > per_case:
            lines.append(f"{name}: ... and {len(found) - per_case} more")
    return "\n".join(lines)
