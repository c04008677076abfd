"""The coordinator in a process of its own, a child of DP rank 0's engine core.

In a thread, the coordinator shares rank 0's interpreter lock with the engine's
busy loop: at DP = 64 and more its 2N messages per renewal (tens of microseconds
of Python each) slow rank 0's passes, and the whole group steps at its slowest
rank's pace (docs/step_sync.md, "Scale"). In a child process it has an interpreter
of its own; rank 0 keeps only a pipe.

The child runs the same :class:`~.coordinator.Coordinator`. Parent and child speak
JSON lines over the child's stdin and stdout, a pipe only they hold (nothing here
listens on a socket but the coordinator itself):

* parent -> child: :class:`Start` (the configuration, where to bind and the group
  key), later :class:`Close`;
* child -> parent: :class:`Ready` (the address it bound) or :class:`Status` with
  ``failed`` set; then a :class:`Status` whenever ``G``, the phase, the members,
  ``all_left`` or the failure changes (within 20 ms), and every 0.25 s for the
  counters.

Either side gone ends the other's part: the child that reads EOF on stdin, or
finds itself re-parented, aborts the group (every rank fails now, not after
``peer_timeout_s``) and exits; the parent that reads EOF on the child's stdout
before it asked for a close reports the group failed.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import msgspec

from vllm_disagg.logger import init_logger
from vllm_disagg.v1.engine.step_sync.config import StepSyncConfig
from vllm_disagg.v1.engine.step_sync.messages import GroupPhase

logger = init_logger(__name__)

# How long the child may take to import, bind and say where: it imports vLLM
# (seconds; more on a loaded host), and rank 0 waits for it before it publishes.
START_TIMEOUT_S = 120.0


class Start(msgspec.Struct, tag="start", forbid_unknown_fields=True):
    dp_size: int
    lookahead: int
    peer_timeout_s: float
    address: str
    key_hex: str
    # vLLM's LoggingConfig of rank 0 (dataclass fields), applied in the child so
    # its lines carry the same format, level and process prefix.
    logging_config: dict | None = None


class Close(msgspec.Struct, tag="close", forbid_unknown_fields=True):
    abort_reason: str
    # After an agreed exit: wait this long for every member to say it left.
    wait_for_left_s: float


class Ready(msgspec.Struct, tag="ready", forbid_unknown_fields=True):
    address: str


class Status(msgspec.Struct, tag="status", forbid_unknown_fields=True):
    step: int
    phase: int
    registered: list[int]
    all_left: bool
    failed: str | None
    stats: dict[str, int]
    cpu_s: float


# Not imported by the package: ``-m`` must find it unimported.
# (Derived from this module's name, so it follows the package when it moves.)
CHILD_MODULE = f"{__name__.rpartition('.')[0]}.coordinator_child"
TO_CHILD = msgspec.json.Decoder(Start | Close)
TO_PARENT = msgspec.json.Decoder(Ready | Status)


def line_of(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg) + b"\n"


class CoordinatorProcess:
    """Rank 0's handle on the coordinator child: the same surface the engine uses
    on a :class:`~.coordinator.Coordinator` (``address``, ``phase``, ``all_left``,
    ``stats``, ``failure``, ``close``), read from the child's latest status."""

    def __init__(
        self,
        config: StepSyncConfig,
        address: str,
        secret: bytes,
        on_failure: Callable[[str], None] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        logging_config=None,
    ):
        self.config = config
        self.on_failure = on_failure or (lambda reason: None)
        self._status = Status(0, int(GroupPhase.RUNNING), [], False, None, {}, 0.0)
        # When the latest status arrived (time.monotonic()).
        self.status_at = time.monotonic()
        self._closing = False
        self._reported: str | None = None
        self._lock = threading.Lock()
        # The key goes through the pipe, never argv or the environment.
        self._proc = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self.pid = self._proc.pid
        start = Start(
            config.dp_size,
            config.lookahead,
            config.peer_timeout_s,
            address,
            secret.hex(),
            None if logging_config is None else dataclasses.asdict(logging_config),
        )
        self._proc.stdin.write(line_of(start))
        self._proc.stdin.flush()
        self.address = self._await_ready(start_timeout_s)
        self._reader = threading.Thread(
            target=self._read_status, name="StepSyncCoordinatorPipe", daemon=True
        )

    def _await_ready(self, timeout_s: float) -> str:
        """The child's first line, within ``timeout_s``; raises with its reason."""
        got: list[bytes] = []
        reader = threading.Thread(
            target=lambda: got.append(self._proc.stdout.readline()), daemon=True
        )
        reader.start()
        reader.join(timeout_s)
        if not got or not got[0]:
            self._proc.kill()
            self._proc.wait()
            why = "exited" if got else f"did not answer within {timeout_s:.0f}s"
            rc = self._proc.returncode
            raise RuntimeError(
                f"the step-sync coordinator process {why} (rc={rc}); "
                "its log lines are above"
            )
        msg = TO_PARENT.decode(got[0])
        if isinstance(msg, Status):
            self._proc.wait()
            raise RuntimeError(f"the step-sync coordinator process: {msg.failed}")
        return msg.address

    def start(self) -> CoordinatorProcess:
        self._reader.start()
        return self

    def _read_status(self) -> None:
        for raw in self._proc.stdout:
            try:
                msg = TO_PARENT.decode(raw)
            except msgspec.DecodeError:
                logger.error("step sync coordinator process: unreadable line")
                continue
            if isinstance(msg, Status):
                with self._lock:
                    self._status, self.status_at = msg, time.monotonic()
                if msg.failed is not None:
                    self._report(msg.failed)
        rc = self._proc.wait()
        if not self._closing:
            self._report(
                f"the step-sync coordinator process (DP rank 0) exited, rc={rc}"
            )

    def _report(self, reason: str) -> None:
        if self._reported is None:
            self._reported = reason
            self.on_failure(reason)

    @property
    def step(self) -> int:
        return self._status.step

    @property
    def phase(self) -> GroupPhase:
        return GroupPhase(self._status.phase)

    @property
    def registered(self) -> list[int]:
        return list(self._status.registered)

    @property
    def all_left(self) -> bool:
        return self._status.all_left

    @property
    def failure(self) -> str | None:
        return self._reported

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._status.stats)

    @property
    def cpu_s(self) -> float:
        """CPU seconds the child used, as of its latest status."""
        return self._status.cpu_s

    def close(self, timeout_s: float = 5.0, abort_reason: str | None = None) -> None:
        """Stop the child: it aborts every member that has not left (after an
        agreed exit it first waits, up to ``peer_timeout_s``, for them to leave)."""
        self._closing = True
        reason = abort_reason or "the coordinator (DP rank 0) shut down"
        wait_s = self.config.peer_timeout_s
        try:
            self._proc.stdin.write(line_of(Close(reason, wait_s)))
            self._proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass  # already gone
        try:
            self._proc.wait(timeout_s + wait_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
