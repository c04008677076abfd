"""Large groups: the coordinator in a child process of rank 0
(``step_sync_coordinator``): what either side going away does to the group,
start-up failures, the key's path; and ``auto`` for both that and the lookahead.

The protocol itself runs against the child in test_step_sync.py (``host``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest
from step_sync_helpers import wait_until

from vllm_disagg import envs
from vllm_disagg.errors import ConfigError
from vllm_disagg.v1.engine.step_sync import (
    CoordinatorProcess,
    GroupPhase,
    Participant,
    StepSyncConfig,
    new_group_secret,
)

# A peer timeout far above every bound below: a failure seen sooner was told, not
# timed out.
PEER_TIMEOUT_S = 60.0


def _participants(config, address, key):
    failures: list[list[str]] = [[] for _ in range(config.dp_size)]
    parts = [
        Participant(
            config,
            rank,
            address,
            key,
            on_grant=lambda step: None,
            on_failure=failures[rank].append,
        ).start()
        for rank in range(config.dp_size)
    ]
    for part in parts:
        part.wait_for_group(30)
    return parts, failures


@dataclass
class ProcessGroup:
    coord: CoordinatorProcess
    reported: list[str]  # what rank 0's handle reported (on_failure)
    parts: list[Participant]
    failures: list[list[str]]  # per rank


@pytest.fixture
def process_group():
    """Factory: (peer_timeout_s) -> a 2-rank group around a coordinator child;
    everything closed at teardown."""
    made: list[ProcessGroup] = []

    def make(peer_timeout_s: float) -> ProcessGroup:
        config = StepSyncConfig(2, peer_timeout_s=peer_timeout_s, coordinator="process")
        key = new_group_secret()
        reported: list[str] = []
        coord = CoordinatorProcess(config, "tcp://127.0.0.1:0", key, reported.append)
        coord.start()
        parts, failures = _participants(config, coord.address, key)
        made.append(ProcessGroup(coord, reported, parts, failures))
        return made[-1]

    yield make
    for group in made:
        group.coord.close(1.0)
        for part in group.parts:
            part.close(0.5)


def _wait_gone(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"process {pid} outlived {timeout_s}s")


RANK0 = textwrap.dedent(
    """
    import sys, time
    from vllm_disagg.v1.engine.step_sync import CoordinatorProcess, StepSyncConfig
    key = bytes.fromhex(sys.stdin.readline().strip())
    config = StepSyncConfig(2, peer_timeout_s={timeout}, coordinator="process")
    coord = CoordinatorProcess(config, "tcp://127.0.0.1:0", key).start()
    print(coord.address, coord.pid, flush=True)
    time.sleep(600)
    """
)


def test_rank_0_killed_aborts_every_rank_through_its_coordinator_child():
    """SIGKILL gives rank 0 no chance to say goodbye; its child sees the pipe close
    and aborts the group, so the ranks fail now, not after the peer timeout."""
    key = new_group_secret()
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0.format(timeout=PEER_TIMEOUT_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        rank0.stdin.write(key.hex() + "\n")
        rank0.stdin.flush()
        address, child = rank0.stdout.readline().split()
        config = StepSyncConfig(2, peer_timeout_s=PEER_TIMEOUT_S)
        parts, failures = _participants(config, address, key)
        killed = time.monotonic()
        rank0.kill()
        wait_until(lambda: all(failures), timeout_s=15, what="both ranks to fail")
        assert time.monotonic() - killed < 15 < PEER_TIMEOUT_S
        for got in failures:
            assert "DP rank 0's engine core exited" in got[0], got
        _wait_gone(int(child), 10)
    finally:
        rank0.kill()
        rank0.wait()
    for part in parts:
        part.close(0.5)


def test_a_coordinator_child_that_dies_fails_rank_0_and_the_ranks(process_group):
    group = process_group(peer_timeout_s=2.0)
    os.kill(group.coord.pid, signal.SIGKILL)
    wait_until(lambda: group.reported, timeout_s=10, what="rank 0's report")
    assert "coordinator process (DP rank 0) exited" in group.reported[0]
    # The ranks hear nothing more: they fail by the peer timeout.
    wait_until(lambda: all(group.failures), timeout_s=15, what="the ranks to fail")
    assert all("coordinator silent" in got[0] for got in group.failures), group.failures


def test_an_agreed_exit_closes_the_child_without_an_abort(process_group):
    group = process_group(peer_timeout_s=PEER_TIMEOUT_S)
    coord = group.coord
    for part in group.parts:
        part.set_leaving()
    wait_until(lambda: coord.phase == GroupPhase.EXITING, what="the exit phase")
    for part in group.parts:
        part.close(2.0)
    wait_until(lambda: coord.all_left, what="every rank to leave")
    coord.close(5.0)
    assert coord._proc.returncode == 0
    assert group.reported == [] and group.failures == [[], []]
    assert coord.stats["frames_received"] > 0


def test_a_child_that_cannot_bind_fails_start_up_with_its_reason():
    config = StepSyncConfig(2, coordinator="process")
    with pytest.raises(RuntimeError, match="step-sync coordinator process: .*Error"):
        CoordinatorProcess(config, "tcp://192.0.2.1:0", new_group_secret())


def test_no_secret_reaches_the_childs_command_line_or_environment(monkeypatch):
    """The child gets the per-group key through its pipe, and not the operator's
    secret it is derived from at all."""
    operator_secret = "s3cr3t-" + new_group_secret().hex()
    monkeypatch.setenv(envs.VLLM_DISAGG_DP_SECRET, operator_secret)
    config = StepSyncConfig(2, coordinator="process")
    key = new_group_secret()
    coord = CoordinatorProcess(config, "tcp://127.0.0.1:0", key).start()
    try:
        for name in ("cmdline", "environ"):
            with open(f"/proc/{coord.pid}/{name}", "rb") as f:
                text = f.read()
            assert key.hex().encode() not in text, name
            assert operator_secret.encode() not in text, name
        # Its own session: a signal to rank 0's process group does not reach it.
        assert os.getsid(coord.pid) != os.getsid(0)
    finally:
        coord.close(1.0)


def test_sigterm_to_the_child_aborts_the_ranks_at_once(process_group):
    group = process_group(peer_timeout_s=PEER_TIMEOUT_S)
    sent = time.monotonic()
    os.kill(group.coord.pid, signal.SIGTERM)
    wait_until(lambda: all(group.failures), timeout_s=15, what="both ranks to fail")
    assert time.monotonic() - sent < 15 < PEER_TIMEOUT_S
    assert all("got SIGTERM" in got[0] for got in group.failures), group.failures
    wait_until(lambda: group.reported, timeout_s=10, what="rank 0's report")


def test_what_the_childs_imports_print_stays_off_the_status_pipe(tmp_path):
    """Anything printed to stdout before the child's main (a sitecustomize, a
    library's banner) goes to rank 0's stdout, not into the protocol."""
    (tmp_path / "sitecustomize.py").write_text("print('hello from sitecustomize')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from vllm_disagg.v1.engine.step_sync import CoordinatorProcess, "
            "StepSyncConfig, new_group_secret\n"
            "c = CoordinatorProcess(StepSyncConfig(2, coordinator='process'), "
            "'tcp://127.0.0.1:0', new_group_secret()).start()\n"
            "print('address', c.address, flush=True)\n"
            "c.close(1.0)\n",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert "address tcp://127.0.0.1:" in probe.stdout
    assert probe.stdout.count("hello from sitecustomize") == 2  # rank 0 and child


@pytest.mark.parametrize(
    ("dp_size", "value", "in_process"),
    [
        (2, "auto", False),
        (31, "auto", False),
        (32, "auto", True),
        (256, "auto", True),
        (256, "thread", False),
        (2, "process", True),
    ],
)
def test_auto_runs_the_coordinator_in_a_process_from_dp_32(dp_size, value, in_process):
    config = StepSyncConfig.from_additional_config(
        {"step_sync_coordinator": value}, dp_size
    )
    assert config.coordinator_in_process is in_process


def test_an_unknown_coordinator_host_names_the_key_and_the_choices():
    allowed = "step_sync_coordinator.*auto, thread, process"
    with pytest.raises(ConfigError, match=allowed):
        StepSyncConfig.from_additional_config({"step_sync_coordinator": "gpu"}, 2)


@pytest.mark.parametrize(
    ("dp_size", "value", "lookahead"),
    [(2, None, 2), (31, "auto", 2), (32, None, 8), (256, "AUTO", 8), (256, 3, 3)],
)
def test_auto_lookahead_grows_from_dp_32(dp_size, value, lookahead):
    """Large groups get a longer lease (fewer coordinator messages per pass); an
    explicit value wins."""
    options = {} if value is None else {"step_sync_lookahead": value}
    config = StepSyncConfig.from_additional_config(options, dp_size)
    assert config.lookahead == lookahead


def test_a_bad_lookahead_names_the_integers_and_auto():
    with pytest.raises(ConfigError, match=r"step_sync_lookahead.*1\.\.1024 or auto"):
        StepSyncConfig.from_additional_config({"step_sync_lookahead": "long"}, 2)
