"""The step-sync coordinator's child process (see coordinator_process.py), started
by DP rank 0 as ``python -m vllm_disagg.v1.engine.step_sync.coordinator_child FD``
(FD: the status pipe's write end)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import msgspec

from vllm_disagg.v1.engine.step_sync.config import StepSyncConfig
from vllm_disagg.v1.engine.step_sync.coordinator_process import (
    TO_CHILD,
    Close,
    Ready,
    Start,
    Status,
    line_of,
)
from vllm_disagg.v1.engine.step_sync.messages import GroupPhase

# The status cadence: changes within STATUS_POLL_S, counters at least every
# STATUS_REFRESH_S.
STATUS_POLL_S = 0.02
STATUS_REFRESH_S = 0.25
PROCESS_NAME = "StepSyncCoordinator"


def main() -> int:
    """The child: run a Coordinator until rank 0 says close or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when this ends
    stopping = threading.Event()
    why = ["DP rank 0's engine core exited"]

    def terminated(signum, frame) -> None:
        # SIGTERM to this process alone: end as if rank 0 were lost, with an Abort.
        why[0] = "the step-sync coordinator process (DP rank 0) got SIGTERM"
        stopping.set()

    signal.signal(signal.SIGTERM, terminated)
    out = StatusPipe(int(sys.argv[1]))
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.utils.system_utils import decorate_logs, set_process_title

    from vllm_disagg.v1.engine.step_sync.coordinator import Coordinator

    parent = os.getppid()
    start = TO_CHILD.decode(sys.stdin.buffer.readline())
    if not isinstance(start, Start):
        return 2
    if start.logging_config is not None:
        configure_logging(LoggingConfig(**start.logging_config))
    set_process_title(PROCESS_NAME)
    decorate_logs(PROCESS_NAME)
    config = StepSyncConfig(start.dp_size, start.lookahead, start.peer_timeout_s)
    try:
        coordinator = Coordinator(
            config, start.address, bytes.fromhex(start.key_hex)
        ).start()
    except Exception as e:  # noqa: BLE001 - said to rank 0, which raises it
        out.send_blocking(Status(0, 0, [], False, f"{type(e).__name__}: {e}", {}, 0.0))
        return 1
    out.send_blocking(Ready(coordinator.address))

    closing: list[Close | None] = []

    def read_parent() -> None:
        line = sys.stdin.buffer.readline()
        try:
            msg = TO_CHILD.decode(line) if line else None
        except msgspec.DecodeError:
            msg = None
        closing.append(msg if isinstance(msg, Close) else None)
        stopping.set()

    threading.Thread(target=read_parent, daemon=True).start()
    close = None
    try:
        last, last_sent = None, 0.0
        while not stopping.is_set() and os.getppid() == parent:
            status = _status_of(coordinator)
            now = time.monotonic()
            key = (
                status.step,
                status.phase,
                len(status.registered),
                status.all_left,
                status.failed,
            )
            if key != last or now - last_sent >= STATUS_REFRESH_S:
                out.send(status)
                last, last_sent = key, now
            else:
                out.flush()
            stopping.wait(STATUS_POLL_S)
        close = closing[0] if closing else None
        if close is not None and coordinator.phase == GroupPhase.EXITING:
            deadline = time.monotonic() + close.wait_for_left_s
            while not coordinator.all_left and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        # Whatever ended the loop, the members hear it now (unless they all left).
        coordinator.close(
            abort_reason=close.abort_reason if close is not None else why[0]
        )
    out.send(_status_of(coordinator))
    out.flush()
    return 0


class StatusPipe:
    """The write end of the status pipe, never blocking the child's loop: a status
    that does not fit waits, and a newer one replaces it (the latest status
    carries everything), so a reader that stalls cannot stop this process from
    watching rank 0. A line already partly written is finished first."""

    def __init__(self, fd: int):
        self.fd = fd
        self._line = b""  # the line being written
        self._sent = 0  # bytes of it written
        self._next: bytes | None = None

    def send_blocking(self, msg: msgspec.Struct) -> None:
        """Before the loop (rank 0 waits for this one)."""
        os.write(self.fd, line_of(msg))  # one short line: written whole
        os.set_blocking(self.fd, False)

    def send(self, msg: msgspec.Struct) -> None:
        line = line_of(msg)
        if self._sent == 0 or self._sent == len(self._line):
            self._line, self._sent, self._next = line, 0, None
        else:
            self._next = line
        self.flush()

    def flush(self) -> None:
        while True:
            if self._sent == len(self._line):
                if self._next is None:
                    return
                self._line, self._sent, self._next = self._next, 0, None
            try:
                self._sent += os.write(self.fd, self._line[self._sent :])
            except BlockingIOError:
                return
            except OSError:  # rank 0 gone: the loop's parent check ends it
                self._line, self._sent, self._next = b"", 0, None
                return


def _status_of(coordinator) -> Status:
    cpu = os.times()
    return Status(
        coordinator.step,
        int(coordinator.phase),
        coordinator.registered,
        coordinator.all_left,
        coordinator.failure,
        coordinator.stats,
        cpu.user + cpu.system,
    )


if __name__ == "__main__":
    sys.exit(main())
