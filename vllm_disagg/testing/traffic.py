"""A deterministic mix of OpenAI requests, driven at bounded concurrency, with
every greedy answer checked against a colocated reference.

:func:`make_specs` turns a seed into a sequence of request shapes:
completions and chats, streamed or not, some cancelled by the client after a
few chunks, prompts sharing prefixes, lists of two prompts, ``n=2`` seeded
sampling. :func:`compute_references` asks a colocated server once per
distinct reference body. :class:`TrafficRun` sends the specs (asyncio +
aiohttp, in a thread of its own, so that the caller can inject faults while
it runs) and records per request: start, end, HTTP status and an outcome:

* ``ok``: complete, and token ids equal the reference where there is one;
* ``wrong``: complete, but the token ids differ;
* ``failed``: an HTTP error, a connection error, an SSE error event, a
  stream that ended without ``[DONE]`` or a finish reason, or no answer
  within the client timeout (``hang``);
* ``cancelled``: closed by this client after ``cancel_after`` chunks (the
  tokens received until then must be a prefix of the reference).

After a failed request its worker waits before the next, as a client would
(``error_backoff_s``, doubled with every failure in a row up to
``max_backoff_s``): a dead router is not hammered in a hot loop, and the
number of failed requests during an outage says how long it lasted at this
client's pace (8 workers: at most 16 failures in the first second, then
about 2 a second).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from vllm_disagg.testing.openai_client import WORDS

MAX_TOKENS = 12
SEEDED_MAX_TOKENS = 8
CANCEL_MAX_TOKENS = 48
CANCEL_AFTER_CHUNKS = 3
COMPLETIONS = "/v1/completions"
CHATS = "/v1/chat/completions"

# Request shapes and their weights in the mix.
SHAPES: dict[str, int] = {
    "completion": 22,
    "completion-stream": 18,
    "chat": 12,
    "chat-stream": 12,
    "prompt-list": 8,
    "n2-seeded": 8,
    "cancel-completion": 12,
    "cancel-chat": 8,
}
SEEDS = (11, 12, 13)


def _prompt_pool(seed: int) -> tuple[list[Any], list[list[dict]]]:
    """Completion prompts (token ids, a third sharing one of 3 two-block
    heads, and some text) and chat conversations."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(3)]
    prompts: list[Any] = []
    for i in range(24):
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(3, 160))]
        prompts.append((heads[i % 3] + tail) if i % 3 == 0 or i % 4 == 0 else tail)
    for _ in range(6):
        prompts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))))
    topics = [
        "prefill and decode",
        "a block of the KV cache",
        "step sync",
        "the router",
        "data parallel ranks",
        "tiny models",
    ]
    chats = []
    for i, topic in enumerate(topics):
        messages = [{"role": "user", "content": f"Tell me about {topic}."}]
        if i % 2:
            messages = [{"role": "system", "content": "Be brief."}, *messages]
        if i % 3 == 2:
            messages += [
                {"role": "assistant", "content": "Which part?"},
                {"role": "user", "content": "All of it, " + " ".join(WORDS[: i + 4])},
            ]
        chats.append(messages)
    return prompts, chats


def ref_key(path: str, body: dict[str, Any]) -> str:
    return path + " " + json.dumps(body, sort_keys=True)


@dataclass(frozen=True)
class Spec:
    """One request: where, what, and what to compare each choice with."""

    index: int
    shape: str
    path: str
    body: dict[str, Any]
    # Per choice index: (reference key, choice index in the reference);
    # empty: unchecked.
    expect: tuple[tuple[str, int], ...] = ()
    cancel_after: int | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Mix:
    """The specs of a run and the reference bodies they need."""

    references: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)

    def reference(self, path: str, body: dict[str, Any]) -> str:
        key = ref_key(path, body)
        self.references.setdefault(key, (path, body))
        return key


def make_specs(
    seed: int, model: str, count: int | None = None, start: int = 0
) -> tuple[Iterator[Spec], Mix]:
    """``count`` specs (None: endless), numbered from ``start``, drawn with
    ``seed``; and the :class:`Mix` whose references they name (every
    reference the mix can name is registered up front)."""
    prompts, chats = _prompt_pool(seed)
    mix = Mix()
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}

    def completion_ref(prompt) -> str:
        return mix.reference(COMPLETIONS, {"model": model, "prompt": prompt, **greedy})

    def chat_ref(messages) -> str:
        return mix.reference(CHATS, {"model": model, "messages": messages, **greedy})

    def seeded_body(prompt, s) -> dict[str, Any]:
        return {
            "model": model,
            "prompt": prompt,
            "n": 2,
            "seed": s,
            "temperature": 0.8,
            "max_tokens": SEEDED_MAX_TOKENS,
            "return_token_ids": True,
        }

    for p in prompts:
        completion_ref(p)
    for c in chats:
        chat_ref(c)
    for i, p in enumerate(prompts[:6]):
        mix.reference(COMPLETIONS, seeded_body(p, SEEDS[i % len(SEEDS)]))

    names, weights = list(SHAPES), list(SHAPES.values())

    def spec(i: int) -> Spec:
        rng = random.Random(f"{seed}:{i}")
        shape = rng.choices(names, weights)[0]
        prompt = rng.choice(prompts)
        messages = rng.choice(chats)
        if shape in ("completion", "completion-stream"):
            body = {
                "model": model,
                "prompt": prompt,
                **greedy,
                "stream": shape.endswith("stream"),
            }
            return Spec(i, shape, COMPLETIONS, body, ((completion_ref(prompt), 0),))
        if shape in ("chat", "chat-stream"):
            body = {
                "model": model,
                "messages": messages,
                **greedy,
                "stream": shape.endswith("stream"),
            }
            return Spec(i, shape, CHATS, body, ((chat_ref(messages), 0),))
        if shape == "prompt-list":
            a, b = rng.sample([p for p in prompts if isinstance(p, list)], 2)
            body = {"model": model, "prompt": [a, b], **greedy}
            return Spec(
                i,
                shape,
                COMPLETIONS,
                body,
                ((completion_ref(a), 0), (completion_ref(b), 0)),
            )
        if shape == "n2-seeded":
            j = rng.randrange(6)
            body = seeded_body(prompts[j], SEEDS[j % len(SEEDS)])
            key = mix.reference(COMPLETIONS, body)
            return Spec(i, shape, COMPLETIONS, body, ((key, 0), (key, 1)))
        cancel = {
            "max_tokens": CANCEL_MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": True,
        }
        if shape == "cancel-completion":
            body = {"model": model, "prompt": prompt, **cancel}
            key = completion_ref(prompt)
        else:
            body = {"model": model, "messages": messages, **cancel}
            key = chat_ref(messages)
        return Spec(
            i,
            shape,
            body=body,
            path=COMPLETIONS if "prompt" in body else CHATS,
            expect=((key, 0),),
            cancel_after=CANCEL_AFTER_CHUNKS,
        )

    def specs() -> Iterator[Spec]:
        i = start
        while count is None or i < start + count:
            yield spec(i)
            i += 1

    return specs(), mix


# --- sending -------------------------------------------------------------------


@dataclass
class Record:
    index: int
    shape: str
    start: float  # seconds since the run's t0
    end: float
    status: int  # HTTP status; 0: no response
    outcome: str  # ok, wrong, failed, cancelled
    detail: str = ""
    ttfb: float | None = None  # seconds to the first byte of the body
    hang: bool = False

    @property
    def latency(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["start"], d["end"] = round(self.start, 4), round(self.end, 4)
        if self.ttfb is not None:
            d["ttfb"] = round(self.ttfb, 4)
        return d


class _Failed(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _choice_tokens(
    choices: Iterable[dict], into: dict[int, list[int]], finished: dict[int, str]
) -> int:
    """Add the token ids of ``choices`` (by index); the number of new tokens."""
    added = 0
    for choice in choices or []:
        idx = int(choice.get("index", 0))
        ids = choice.get("token_ids") or []
        into.setdefault(idx, []).extend(ids)
        added += len(ids)
        if choice.get("finish_reason"):
            finished[idx] = choice["finish_reason"]
    return added


async def _send(
    session: aiohttp.ClientSession, url: str, spec: Spec, timeout_s: float
) -> tuple[int, dict[int, list[int]], bool, float | None]:
    """(status, token ids by choice index, cancelled by us, time to first byte)."""
    started = time.monotonic()
    tokens: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(url + spec.path, json=spec.body, timeout=timeout) as resp:
        if resp.status != 200:
            text = (await resp.text())[:300]
            raise _Failed(resp.status, f"HTTP {resp.status}: {text}")
        if not spec.stream:
            body = await resp.json()
            ttfb = time.monotonic() - started
            _choice_tokens(body.get("choices"), tokens, finished)
            want = {i for i, _ in enumerate(spec.expect)} or {0}
            if not want <= set(finished):
                raise _Failed(200, f"choices without finish_reason: {sorted(finished)}")
            return 200, tokens, False, ttfb
        ttfb = None
        chunks = 0
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if ttfb is None:
                ttfb = time.monotonic() - started
            if line == b"data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                raise _Failed(200, f"stream error event: {json.dumps(event)[:300]}")
            if _choice_tokens(event.get("choices"), tokens, finished):
                chunks += 1
            if spec.cancel_after is not None and chunks >= spec.cancel_after:
                resp.close()  # the client goes away mid-stream
                return 200, tokens, True, ttfb
        if not done:
            raise _Failed(200, f"stream ended without [DONE] after {chunks} chunks")
        want = {i for i, _ in enumerate(spec.expect)} or {0}
        if not want <= set(finished):
            raise _Failed(
                200, f"stream choices without finish_reason: {sorted(finished)}"
            )
        return 200, tokens, False, ttfb


def judge(
    spec: Spec,
    tokens: dict[int, list[int]],
    cancelled: bool,
    references: dict[str, list[list[int]]],
) -> tuple[str, str]:
    """(outcome, detail) of a complete answer against the references."""
    for i, (key, ref_index) in enumerate(spec.expect):
        expected = references.get(key)
        if expected is None:
            continue
        want = expected[ref_index]
        got = tokens.get(i, [])
        if cancelled:
            n = min(len(got), len(want))
            if got[:n] != want[:n]:
                return "wrong", f"choice {i}: prefix {got[:n]} != reference {want[:n]}"
        elif got != want:
            return "wrong", f"choice {i}: {got} != reference {want}"
    return ("cancelled" if cancelled else "ok"), ""


class TrafficRun:
    """Send specs at bounded concurrency from a thread of its own.

    ``start()`` returns at once; ``records`` fills as requests end; ``wait()``
    returns when every spec was sent and answered, ``stop()`` was called, or
    the run's deadline passed (nothing new is sent after it; requests in
    flight get at most ``request_timeout_s``).
    """

    def __init__(
        self,
        url: str,
        specs: Iterable[Spec],
        references: dict[str, list[list[int]]],
        *,
        concurrency: int = 8,
        duration_s: float = 600.0,
        request_timeout_s: float = 120.0,
        error_backoff_s: float = 0.5,
        max_backoff_s: float = 4.0,
        t0: float | None = None,
    ):
        self.url = url
        self.specs = iter(specs)
        self.references = references
        self.concurrency = concurrency
        self.duration_s = duration_s
        self.request_timeout_s = request_timeout_s
        self.error_backoff_s = error_backoff_s
        self.max_backoff_s = max_backoff_s
        self.t0 = time.monotonic() if t0 is None else t0
        self.records: list[Record] = []
        self.in_flight = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> TrafficRun:
        self._thread = threading.Thread(target=self._main, name="traffic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """True when the run ended within ``timeout_s``."""
        assert self._thread is not None
        bound = self.duration_s + self.request_timeout_s + 30
        self._thread.join(bound if timeout_s is None else timeout_s)
        if self.error is not None:
            raise self.error
        return not self._thread.is_alive()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def done_count(self) -> int:
        return len(self.records)

    def wait_for(self, count: int, timeout_s: float) -> bool:
        """Wait until ``count`` requests ended (or the run ended / timed out)."""
        deadline = time.monotonic() + timeout_s
        while len(self.records) < count and time.monotonic() < deadline:
            if self._thread is not None and not self._thread.is_alive():
                return len(self.records) >= count
            time.sleep(0.1)
        return len(self.records) >= count

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            self.error = e

    async def _run(self) -> None:
        deadline = time.monotonic() + self.duration_s
        # A fresh connection per request: a failure is the server's, never a
        # stale pooled connection's (a restarted router would show those).
        connector = aiohttp.TCPConnector(limit=self.concurrency * 2, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            workers = [
                asyncio.create_task(self._worker(session, deadline))
                for _ in range(self.concurrency)
            ]
            await asyncio.gather(*workers)

    async def _worker(self, session: aiohttp.ClientSession, deadline: float) -> None:
        failures = 0  # in a row
        while not self._stop.is_set() and time.monotonic() < deadline:
            spec = next(self.specs, None)
            if spec is None:
                return
            record = await self._one(session, spec)
            self.records.append(record)
            if record.outcome == "failed":
                failures += 1
                backoff = min(
                    self.max_backoff_s, self.error_backoff_s * 2 ** (failures - 1)
                )
                await asyncio.sleep(backoff)
            else:
                failures = 0

    async def _one(self, session: aiohttp.ClientSession, spec: Spec) -> Record:
        start = self.now()
        self.in_flight += 1
        status, detail, hang, ttfb = 0, "", False, None
        try:
            status, tokens, cancelled, ttfb = await asyncio.wait_for(
                _send(session, self.url, spec, self.request_timeout_s),
                self.request_timeout_s + 5,
            )
            outcome, detail = judge(spec, tokens, cancelled, self.references)
        except _Failed as e:
            outcome, status, detail = "failed", e.status, e.detail
        except (asyncio.TimeoutError, TimeoutError):
            outcome, hang = "failed", True
            detail = f"no answer within {self.request_timeout_s:.0f}s (client timeout)"
        except (aiohttp.ClientError, OSError, ValueError) as e:
            outcome, detail = "failed", f"{type(e).__name__}: {e}"[:300]
        finally:
            self.in_flight -= 1
        return Record(
            spec.index,
            spec.shape,
            start,
            self.now(),
            status,
            outcome,
            detail,
            ttfb,
            hang,
        )


def compute_references(
    url: str, mix: Mix, *, concurrency: int = 8, timeout_s: float = 120.0
) -> dict[str, list[list[int]]]:
    """Token ids per choice of every reference body, asked of ``url`` (a
    colocated server) once each; raises if any fails."""

    async def one(session, sem, key, path, body) -> tuple[str, list[list[int]]]:
        async with (
            sem,
            session.post(
                url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp,
        ):
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(
                    f"reference {key[:120]}: HTTP {resp.status} {text[:300]}"
                )
            choices = sorted(json.loads(text)["choices"], key=lambda c: c["index"])
            return key, [list(c["token_ids"]) for c in choices]

    async def main() -> dict[str, list[list[int]]]:
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession() as session:
            pairs = await asyncio.gather(
                *(
                    one(session, sem, key, path, body)
                    for key, (path, body) in mix.references.items()
                )
            )
        return dict(pairs)

    return asyncio.run(main())


# --- figures ---------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def summarize(records: list[Record]) -> dict[str, Any]:
    """Counts by outcome and shape, latency percentiles of answered requests."""
    outcomes = Counter(r.outcome for r in records)
    ok_latency = [r.latency for r in records if r.outcome == "ok"]
    return {
        "issued": len(records),
        "ok": outcomes.get("ok", 0),
        "failed": outcomes.get("failed", 0),
        "wrong": outcomes.get("wrong", 0),
        "cancelled": outcomes.get("cancelled", 0),
        "hangs": sum(r.hang for r in records),
        "by_shape": {
            shape: dict(Counter(r.outcome for r in records if r.shape == shape))
            for shape in sorted({r.shape for r in records})
        },
        "latency_s": {
            "p50": _round(percentile(ok_latency, 50)),
            "p90": _round(percentile(ok_latency, 90)),
            "p99": _round(percentile(ok_latency, 99)),
            "max": _round(max((r.latency for r in records), default=None)),
        },
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def recovery(records: list[Record], fault_at: float) -> dict[str, Any]:
    """How the run went after a fault at ``fault_at`` (seconds since t0):

    * ``recovered_s``: from the fault to the start of the first request
      after which every request that started succeeded (0 when no request
      started after the fault failed; None when failures went on to the end);
    * ``errors_until_s``: from the fault to the end of the last failed
      request (0 when none failed after the fault).
    """
    bad = [r for r in records if r.outcome in ("failed", "wrong")]
    after = sorted((r for r in records if r.start >= fault_at), key=lambda r: r.start)
    last_bad_start = max(
        (r.start for r in after if r.outcome in ("failed", "wrong")), default=None
    )
    if last_bad_start is None:
        recovered = 0.0
    else:
        good_after = [
            r for r in after if r.start > last_bad_start and r.outcome == "ok"
        ]
        recovered = (good_after[0].start - fault_at) if good_after else None
    errors_until = max(
        (r.end - fault_at for r in bad if r.end >= fault_at), default=0.0
    )
    return {
        "recovered_s": _round(recovered),
        "errors_until_s": _round(max(0.0, errors_until)),
        "failed_after_fault": sum(1 for r in bad if r.end >= fault_at),
        "failed_before_fault": sum(1 for r in bad if r.end < fault_at),
    }
