"""The coordinator in a process of its own, a child of DP rank 0's engine core.

In a thread, the coordinator shares rank 0's interpreter lock with the engine's
busy loop: at DP = 64 and more its 2N messages per renewal (tens of microseconds
of Python each) slow rank 0's passes, and the whole group steps at its slowest
rank's pace (docs/step_sync.md, "Scale"). In a child process it has an interpreter
of its own; rank 0 keeps only a pipe.

The child runs the same :class:`~.coordinator.Coordinator`. Rank 0 and the child
speak JSON lines over two pipes (nothing here listens on a socket but the
coordinator itself): rank 0 writes to the child's stdin, the child to a pipe of its
own (its descriptor number is its one argument; stdout stays free for whatever
its imports print):

* rank 0 -> child: :class:`Start` (the configuration, where to bind, the group key
  and rank 0's logging configuration), later :class:`Close`;
* child -> rank 0: :class:`Ready` (the address it bound) or :class:`Status` with
  ``failed`` set; then a :class:`Status` whenever ``G``, the phase, the members,
  ``all_left`` or the failure changes (within 20 ms), and every 0.25 s for the
  counters. The child never blocks on that pipe: a status that does not fit
  waits, and a newer one replaces it (state, not events).

Either side gone ends the other's part: the child that finds itself re-parented
or reads EOF on stdin (workers forked from rank 0 later may hold its write end
too, so re-parenting is the signal that always comes) aborts the group (every
rank fails now, not after ``peer_timeout_s``) and exits; rank 0 that reads EOF on
the status pipe before it asked for a close reports the group failed. The child
runs in a session of its own, so a signal to rank 0's process group (Ctrl-C, a
service manager's SIGTERM) reaches rank 0 only, which then ends the child with an
Abort to every rank; a SIGTERM sent to the child itself does the same.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from vllm_disagg import envs
from vllm_disagg.logger import init_logger
from vllm_disagg.v1.engine.step_sync.config import StepSyncConfig
from vllm_disagg.v1.engine.step_sync.messages import GroupPhase

logger = init_logger(__name__)

# How long the child may take to import, bind and say where: it imports vLLM
# (seconds; more on a loaded host), and rank 0 waits for it before it publishes.
START_TIMEOUT_S = 120.0
# After an agreed exit, how long the child still waits for members to leave: rank
# 0's engine already waited for that, on a status up to 20 ms old.
CLOSE_WAIT_FOR_LEFT_S = 2.0
# What the child's own close takes at most: its thread's join (5 s) and the
# Aborts' linger (0.5 s).
CHILD_CLOSE_S = 6.0


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
        # Child -> rank 0 on a pipe of its own (not stdout, where whatever the
        # child's imports print would land); rank 0 -> child on stdin.
        status_r, status_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", CHILD_MODULE, str(status_w)],
                stdin=subprocess.PIPE,
                pass_fds=(status_w,),
                env=_child_env(),
                # Out of rank 0's process group: a signal to the whole group
                # (Ctrl-C, a service manager's SIGTERM) reaches rank 0, which
                # ends the child with an Abort to every rank; killing the child
                # first would leave the ranks to time out.
                start_new_session=True,
            )
        finally:
            os.close(status_w)
        self.pid = self._proc.pid
        self._status_pipe = os.fdopen(status_r, "rb")
        start = Start(
            config.dp_size,
            config.lookahead,
            config.peer_timeout_s,
            address,
            secret.hex(),  # through the pipe, never argv or the environment
            None if logging_config is None else dataclasses.asdict(logging_config),
        )
        try:
            self._proc.stdin.write(line_of(start))
            self._proc.stdin.flush()
            self.address = self._await_ready(start_timeout_s)
        except BaseException as e:
            self._kill()
            if isinstance(e, RuntimeError):
                raise
            raise RuntimeError(
                f"the step-sync coordinator process failed to start "
                f"(rc={self._proc.returncode}): {type(e).__name__}: {e}; "
                "its log lines are above"
            ) from None
        self._reader = threading.Thread(
            target=self._read_status, name="StepSyncCoordinatorPipe", daemon=True
        )

    def _kill(self) -> None:
        self._closing = True
        self._proc.kill()
        self._proc.wait()
        self._status_pipe.close()

    def _await_ready(self, timeout_s: float) -> str:
        """The child's first message, within ``timeout_s``; raises with its reason."""
        got: list[bytes] = []
        reader = threading.Thread(
            target=lambda: got.append(self._status_pipe.readline()), daemon=True
        )
        reader.start()
        reader.join(timeout_s)
        if not got or not got[0]:
            why = "exited" if got else f"did not answer within {timeout_s:.0f}s"
            raise RuntimeError(
                f"the step-sync coordinator process {why}; its log lines are above"
            )
        msg = TO_PARENT.decode(got[0])
        if isinstance(msg, Status):
            raise RuntimeError(f"the step-sync coordinator process: {msg.failed}")
        return msg.address

    def start(self) -> CoordinatorProcess:
        self._reader.start()
        return self

    def _read_status(self) -> None:
        """Reader thread: the latest status wins; reads until the child closes
        its end, whatever a line holds (a child blocked on a full pipe would
        stop watching rank 0)."""
        for raw in self._status_pipe:
            try:
                msg = TO_PARENT.decode(raw)
                if isinstance(msg, Status):
                    with self._lock:
                        self._status, self.status_at = msg, time.monotonic()
                    if msg.failed is not None:
                        self._report(msg.failed)
            except Exception:
                logger.exception("step sync coordinator process: bad status line")
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

    def close(
        self,
        timeout_s: float = 5.0,
        abort_reason: str | None = None,
        wait_for_left_s: float = CLOSE_WAIT_FOR_LEFT_S,
    ) -> None:
        """Stop the child: it aborts every member that has not left. After an
        agreed exit it first waits up to ``wait_for_left_s`` for them to leave
        (the engine has already waited, on the status it saw)."""
        self._closing = True
        reason = abort_reason or "the coordinator (DP rank 0) shut down"
        try:
            self._proc.stdin.write(line_of(Close(reason, wait_for_left_s)))
            self._proc.stdin.close()
        except (OSError, ValueError):
            pass  # already gone
        try:
            self._proc.wait(timeout_s + wait_for_left_s + CHILD_CLOSE_S)
        except subprocess.TimeoutExpired:
            logger.error("step sync coordinator process: did not exit; killing it")
            self._proc.kill()
            self._proc.wait()


def _child_env() -> dict[str, str]:
    """The child's environment: rank 0's, without the operator's group secret
    (the child gets only the per-group key, through the pipe), and with this
    package's root on ``PYTHONPATH`` (rank 0 may have found it some other way)."""
    env = dict(os.environ)
    for name in (envs.VLLM_DISAGG_DP_SECRET, envs.VLLM_DISAGG_DP_LAUNCH_SECRET):
        env.pop(name, None)
    root = str(Path(__file__).resolve().parents[len(__name__.split(".")) - 1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env
