"""Whether this engine makes progress, for the heartbeats routers read.

A live API server and a heartbeating engine core say nothing about a model
that stopped stepping: a worker hung in a kernel or a collective, a DP rank
whose group stopped, a process starved of CPU. The scheduler side of the
connector sees every request arrive (``on_new_request``) and leave
(``request_finished``) and every step being scheduled
(``build_connector_meta``); an engine that holds requests and schedules no
step for a while is stuck, whatever its ``/health`` says. The registration
thread reports :meth:`EngineProgress.stalled_s` in each heartbeat and the
router stops sending new work past its ``--stall-timeout-s``.

Written by the engine-core thread, read by the registration thread: plain
attribute reads and writes, each atomic under the interpreter lock.
"""

from __future__ import annotations

import time


class EngineProgress:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._live: set[str] = set()
        self._last_step = clock()

    def request_added(self, request_id: str) -> None:
        if not self._live:
            # Idle until now: the wait for a step starts with this request.
            self._last_step = self._clock()
        self._live.add(request_id)

    def request_finished(self, request_id: str) -> None:
        self._live.discard(request_id)

    def step_scheduled(self) -> None:
        self._last_step = self._clock()

    def stalled_s(self) -> float:
        """Seconds since the last step while requests wait; 0 when idle."""
        if not self._live:
            return 0.0
        return max(0.0, self._clock() - self._last_step)

    @property
    def live_requests(self) -> int:
        return len(self._live)
