"""--data-parallel-sync: the config fields, the flags, and the class each
factory picks for "wave" and "step" (no engine started)."""

from types import SimpleNamespace

import pytest

from vllm.config import ParallelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine import core_client
from vllm.v1.engine.core_client import (
    DPAsyncMPClient,
    DPLBAsyncMPClient,
    EngineCoreClient,
    SyncMPClient,
)
from vllm.v1.engine.step_sync.clients import (
    StepSyncDPAsyncMPClient,
    StepSyncDPLBAsyncMPClient,
    StepSyncSyncMPClient,
)

pytestmark = pytest.mark.cpu_test


def test_defaults_keep_dp_waves():
    config = ParallelConfig()
    assert config.data_parallel_sync == "wave"
    assert config.data_parallel_sync_lookahead is None  # by the group's size
    assert config.data_parallel_sync_peer_timeout_seconds == 30.0
    assert config.data_parallel_sync_coordinator == "auto"


def test_flags_set_the_fields():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--data-parallel-sync",
            "step",
            "--data-parallel-sync-lookahead",
            "4",
            "--data-parallel-sync-peer-timeout-seconds",
            "2.5",
            "--data-parallel-sync-coordinator",
            "process",
        ]
    )
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.data_parallel_sync == "step"
    assert engine_args.data_parallel_sync_lookahead == 4
    assert engine_args.data_parallel_sync_peer_timeout_seconds == 2.5
    assert engine_args.data_parallel_sync_coordinator == "process"


def test_bad_values_are_refused():
    for flag, value in (
        ("--data-parallel-sync", "steps"),
        ("--data-parallel-sync-coordinator", "threads"),
    ):
        with pytest.raises(SystemExit):
            EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
                [flag, value]
            )
    with pytest.raises(ValueError, match="data_parallel_sync_lookahead"):
        ParallelConfig(data_parallel_sync_lookahead=0)
    with pytest.raises(ValueError, match="data_parallel_sync_peer_timeout_seconds"):
        ParallelConfig(data_parallel_sync_peer_timeout_seconds=0)
    with pytest.raises(ValueError, match="data_parallel_sync_coordinator"):
        ParallelConfig(data_parallel_sync_coordinator="threads")


def test_step_refuses_fault_tolerance():
    """It re-forms the DP group, not the step-sync group."""
    with pytest.raises(ValueError, match="enable_fault_tolerance"):
        ParallelConfig(data_parallel_sync="step", enable_fault_tolerance=True)


def _config(sync: str, external_lb: bool = False):
    parallel = SimpleNamespace(
        data_parallel_size=2,
        data_parallel_external_lb=external_lb,
        data_parallel_sync=sync,
    )
    return SimpleNamespace(parallel_config=parallel)


@pytest.fixture
def no_client_init(monkeypatch):
    """Constructing a client starts nothing."""
    for cls in (
        SyncMPClient,
        core_client.AsyncMPClient,
        DPAsyncMPClient,
        DPLBAsyncMPClient,
        StepSyncSyncMPClient,
        StepSyncDPAsyncMPClient,
        StepSyncDPLBAsyncMPClient,
    ):
        monkeypatch.setattr(cls, "__init__", lambda self, *args, **kwargs: None)


@pytest.mark.parametrize(
    ("sync", "expected"), [("wave", SyncMPClient), ("step", StepSyncSyncMPClient)]
)
def test_make_client_picks_the_sync_client(no_client_init, sync, expected):
    client = EngineCoreClient.make_client(
        multiprocess_mode=True,
        asyncio_mode=False,
        vllm_config=_config(sync),
        executor_class=object,
        log_stats=False,
    )
    assert type(client) is expected


@pytest.mark.parametrize(
    ("sync", "external_lb", "expected"),
    [
        ("wave", False, DPLBAsyncMPClient),
        ("wave", True, DPAsyncMPClient),
        ("step", False, StepSyncDPLBAsyncMPClient),
        ("step", True, StepSyncDPAsyncMPClient),
    ],
)
def test_make_async_mp_client_picks_the_dp_client(
    no_client_init, sync, external_lb, expected
):
    client = EngineCoreClient.make_async_mp_client(
        _config(sync, external_lb), object, False
    )
    assert type(client) is expected
