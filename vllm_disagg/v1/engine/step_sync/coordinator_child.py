"""The step-sync coordinator's child process (see coordinator_process.py), started
by DP rank 0 as ``python -m vllm_disagg.v1.engine.step_sync.coordinator_child``."""

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
    # The pipe to rank 0 moves to a descriptor of its own, and descriptor 1 becomes
    # stderr: vLLM's log handler writes to sys.stdout, which must not reach the pipe.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    # Ctrl-C reaches the whole process group: rank 0 decides when this one ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    except Exception as e:  # noqa: BLE001 - said to the parent, which raises it
        out.write(line_of(Status(0, 0, [], False, f"{type(e).__name__}: {e}", {}, 0.0)))
        out.flush()
        return 1
    out.write(line_of(Ready(coordinator.address)))
    out.flush()

    closing: list[Close | None] = []

    def read_parent() -> None:
        line = sys.stdin.buffer.readline()
        try:
            msg = TO_CHILD.decode(line) if line else None
        except msgspec.DecodeError:
            msg = None
        closing.append(msg if isinstance(msg, Close) else None)

    threading.Thread(target=read_parent, daemon=True).start()
    last, last_sent = None, 0.0
    while not closing and os.getppid() == parent:
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
            try:
                out.write(line_of(status))
                out.flush()
            except BrokenPipeError:
                break
            last, last_sent = key, now
        time.sleep(STATUS_POLL_S)
    close = closing[0] if closing else None
    if close is None:
        coordinator.close(abort_reason="DP rank 0's engine core exited")
        return 0
    if coordinator.phase == GroupPhase.EXITING:
        deadline = time.monotonic() + close.wait_for_left_s
        while not coordinator.all_left and time.monotonic() < deadline:
            time.sleep(0.01)
    coordinator.close(abort_reason=close.abort_reason)
    try:
        out.write(line_of(_status_of(coordinator)))
        out.flush()
    except BrokenPipeError:
        pass
    return 0


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
