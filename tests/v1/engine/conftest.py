"""Fixtures for the step-sync unit tests (helpers in step_sync_helpers.py)."""

from __future__ import annotations

import pytest
from step_sync_helpers import LossyRelay, SimEngine

from vllm_disagg.v1.engine.step_sync import (
    Coordinator,
    CoordinatorProcess,
    StepSyncConfig,
    new_group_secret,
)


@pytest.fixture
def group():
    """Factory: (dp_size, work, ...) -> (coordinator, [SimEngine]); ``relay`` puts
    a LossyRelay between rank 0 and the coordinator; ``host="process"`` runs the
    coordinator in its child process (CoordinatorProcess)."""
    made = []

    def make(
        dp_size,
        work,
        lookahead=2,
        timeout_s=10.0,
        delays=None,
        relay=False,
        host="thread",
    ):
        config = StepSyncConfig(
            dp_size=dp_size,
            lookahead=lookahead,
            peer_timeout_s=timeout_s,
            coordinator=host,
        )
        secret = new_group_secret()
        failures: list[str] = []
        host_class = CoordinatorProcess if host == "process" else Coordinator
        coord = host_class(
            config, "tcp://127.0.0.1:0", secret, on_failure=failures.append
        )
        coord.failures = failures
        coord.start()
        proxy = LossyRelay(coord.address) if relay else None
        engines = []
        for r in range(dp_size):
            address = proxy.address if proxy is not None and r == 0 else coord.address
            delay = (delays or [0] * dp_size)[r]
            engines.append(
                SimEngine(config, r, address, secret, work[r], delay).start()
            )
        made.append((coord, engines, proxy))
        return (coord, engines, proxy) if relay else (coord, engines)

    yield make
    for coord, engines, proxy in made:
        coord.close(timeout_s=1)
        for engine in engines:
            engine.close()
        if proxy is not None:
            proxy.close()
