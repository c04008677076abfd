"""One child process that tests and benchmarks start, watch and stop.

:class:`ManagedProcess` is what a ``vllm serve`` server, a router and a
benchmark's helper servers have in common: the child runs in a session of its
own (so its process group is everything it starts) with its output in a log
file; :meth:`~ManagedProcess.wait_ready` polls an HTTP URL until it answers 200
and notices at once when the child dies instead; :meth:`~ManagedProcess.stop`
sends SIGTERM, waits, then SIGKILLs the whole group, so nothing outlives it;
:meth:`~ManagedProcess.log_tail` is what a failure shows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from http.client import HTTPException
from pathlib import Path

DEFAULT_STOP_TIMEOUT_S = 30.0


class ProcessStartupError(RuntimeError):
    pass


def stop_process_group(
    proc: subprocess.Popen | None, timeout_s: float = DEFAULT_STOP_TIMEOUT_S
) -> int | None:
    """SIGTERM a child started in a session of its own, wait up to
    ``timeout_s``, then SIGKILL its process group (what it started and left
    behind, or itself if it lingers). Its exit status, None if never started."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=timeout_s)


def _answers_200(url: str) -> bool:
    """Whether ``url`` answers 200 (urllib: benchmarks import this module
    before they check their third-party requirements)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status == 200
    except (OSError, HTTPException):  # URLError and HTTPError are OSErrors
        return False


class ManagedProcess:
    """A child with its own process group and its output in ``log_path``.

    Subclasses set :attr:`command` (an attribute or a property),
    :attr:`ready_url` and the timeouts; :attr:`startup_error` is what a failed
    start raises."""

    name = "process"
    startup_error: type[Exception] = ProcessStartupError
    startup_timeout_s = 60.0
    stop_timeout_s = DEFAULT_STOP_TIMEOUT_S
    poll_interval_s = 0.2
    DEFAULT_TAIL_LINES = 80

    command: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    @property
    def ready_url(self) -> str:
        """The URL that answers 200 once the child is ready."""
        raise NotImplementedError

    def launch(self) -> ManagedProcess:
        """Start the child without waiting for it."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(
                f"{self.name} already running (pid {self.proc.pid}); stop() it first"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The child holds its own copy of the log's descriptor.
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        return self

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Poll :attr:`ready_url` until it answers 200. The child's exit ends
        the wait at once; so does the deadline, which also stops the child."""
        proc = self.proc
        if proc is None:
            raise RuntimeError(f"{self.name} was never launched")
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                self.stop()  # what it started may still run in its group
                raise self.startup_error(
                    f"{self.name} exited with {proc.returncode} during start-up\n"
                    + self.log_tail()
                )
            if _answers_200(self.ready_url):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Sleeping in wait() wakes up as soon as the child exits.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=min(self.poll_interval_s, left))
        self.stop()
        raise self.startup_error(
            f"{self.name} not ready after {timeout_s:.0f}s\n" + self.log_tail()
        )

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM the child, then SIGKILL its process group if anything of it
        lingers. Its exit status, None if it was never started."""
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        return stop_process_group(self.proc, timeout_s)

    def kill(self) -> None:
        """SIGKILL the whole process group at once: a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=self.stop_timeout_s)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int | None = None) -> str:
        lines = lines or self.DEFAULT_TAIL_LINES
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- last {lines} lines of {self.log_path} ---\n{tail}"
