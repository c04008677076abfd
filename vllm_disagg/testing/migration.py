"""Clients for the migration end-to-end test: requests in flight in threads
of their own, so that the test can kill the decode serving them after some
chunks arrived, then read what each client got in the end.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psutil
import requests

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


class InFlight(threading.Thread):
    """One request through ``url``: a stream (every event kept, ``[DONE]``
    as the string) or a whole answer (``answer``); ``error`` if it failed."""

    def __init__(self, url: str, path: str, body: dict[str, Any], timeout_s: float):
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.timeout_s = url, path, body, timeout_s
        self.events: list[Any] = []
        self.answer: dict[str, Any] | None = None
        self.status: int | None = None
        self.error: str | None = None
        self.finished = threading.Event()
        self.started_at: float | None = None  # time.monotonic() of the request
        self.first_event_at: float | None = None  # and of its first stream event

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def run(self) -> None:
        self.started_at = time.monotonic()
        try:
            with requests.post(
                self.url + self.path,
                json=self.body,
                stream=self.stream,
                timeout=self.timeout_s,
            ) as r:
                self.status = r.status_code
                if not self.stream:
                    self.answer = r.json()
                    return
                for line in r.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if self.first_event_at is None:
                        self.first_event_at = time.monotonic()
                    self.events.append(
                        "[DONE]" if data == b"[DONE]" else json.loads(data)
                    )
        except Exception as e:  # noqa: BLE001 - judged by the test
            self.error = repr(e)[:300]
        finally:
            self.finished.set()

    def describe(self) -> str:
        """One line for a failure message: where this client stands."""
        waited = (
            None
            if self.first_event_at is None or self.started_at is None
            else round(self.first_event_at - self.started_at, 2)
        )
        try:
            ended = f"finish={self.finish_reason()} tokens={len(self.token_ids())} "
        except (KeyError, IndexError, TypeError):  # a body of another shape
            ended = ""
        return (
            f"{'done' if self.finished.is_set() else 'open'} status={self.status} "
            f"chunks={len(self.chunks())} {ended}first_event_s={waited} "
            f"errors={self.errors()[-1:]} error={self.error}"
        )

    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict) and "error" not in e]

    def errors(self) -> list[dict[str, Any]]:
        return [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]

    def done_count(self) -> int:
        return sum(e == "[DONE]" for e in self.events)

    def token_ids(self) -> list[int]:
        if self.answer is not None:
            return list(self.answer["choices"][0].get("token_ids") or [])
        return [
            t
            for c in self.chunks()
            for choice in c.get("choices") or ()
            for t in choice.get("token_ids") or ()
        ]

    def text(self) -> str:
        if self.answer is not None:
            choice = self.answer["choices"][0]
            return choice["text"] if "text" in choice else choice["message"]["content"]
        return "".join(
            choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            for c in self.chunks()
            for choice in c.get("choices") or ()
        )

    def finish_reason(self) -> str | None:
        if self.answer is not None:
            return self.answer["choices"][0]["finish_reason"]
        reasons = [
            choice.get("finish_reason")
            for c in self.chunks()
            for choice in c.get("choices") or ()
            if choice.get("finish_reason") is not None
        ]
        return reasons[-1] if len(reasons) == 1 else f"{len(reasons)} finish reasons"

    def usage(self) -> dict[str, Any] | None:
        if self.answer is not None:
            return self.answer.get("usage")
        usages = [c["usage"] for c in self.chunks() if c.get("usage")]
        return usages[-1] if usages else None

    def ids(self) -> set[tuple[Any, Any, Any]]:
        """The ``(id, created, model)`` of every chunk (one, when unchanged)."""
        source = [self.answer] if self.answer is not None else self.chunks()
        return {(c.get("id"), c.get("created"), c.get("model")) for c in source}


def engine_cores(server_pid: int) -> list[psutil.Process]:
    """The engine-core processes under the ``vllm serve`` process
    ``server_pid`` (none once it is gone)."""

    def is_core(proc: psutil.Process) -> bool:
        try:
            # vLLM retitles the process "VLLM::EngineCore[_DPn]" (setproctitle)
            return any("EngineCore" in part for part in proc.cmdline()[:1])
        except psutil.Error:
            return False

    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.Error:
        return []
    return [c for c in children if is_core(c)]


@contextmanager
def engine_steps_held(server_pid: int) -> Iterator[None]:
    """Stop the engine core of the ``vllm serve`` process ``server_pid``
    (SIGSTOP) for the block, and let it go on after (SIGCONT). Its API server
    keeps taking requests and its worker keeps receiving KV; no step runs, so
    requests that arrive meanwhile all start together when it goes on. Its
    heartbeats stop too: a router with the default heartbeat timeout removes
    it after 10 s."""
    cores = engine_cores(server_pid)
    if len(cores) != 1:
        raise AssertionError(f"expected one engine core under {server_pid}: {cores}")
    cores[0].send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        cores[0].send_signal(signal.SIGCONT)


def decode_load(router, http_addr: str) -> int:
    """Requests holding a lease on ``http_addr`` through ``router``."""
    for found in router.instances():
        if found["http_addr"] == http_addr:
            return int(found["outstanding"])
    return 0


def wait_until(
    predicate, timeout_s: float, what: str, pace_s: float = 0.05, state=None
) -> None:
    """Poll ``predicate`` until true; past ``timeout_s`` fail with ``what``
    and, when given, ``state()``: what the system looked like then, so that a
    failure on a CI host says why, not only that."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            found = "" if state is None else f"; state: {state()}"
            raise AssertionError(f"not within {timeout_s:g}s: {what}{found}")
        time.sleep(pace_s)


def router_metric(router, name: str, **labels: str) -> float:
    """A sample of the router's /metrics (0 when absent)."""
    text = requests.get(f"{router.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
