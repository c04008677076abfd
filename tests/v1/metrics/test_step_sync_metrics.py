"""Step-sync metrics from engine-core writers to what ``/metrics`` serves,
both ways vLLM runs it, without a server:

* one API server: writers leave JSON snapshots in ``VLLM_DISAGG_METRICS_DIR``
  and the patched ``get_prometheus_registry`` adds a collector reading them;
* several API servers (``PROMETHEUS_MULTIPROC_DIR``): writers update
  prometheus_client metrics that multiprocess mode writes to that directory,
  and upstream's registry (a ``MultiProcessCollector``) reads them back; the
  patch adds nothing.

prometheus_client picks its multiprocess value class when it is imported, so
every process of the multiprocess case is a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_disagg import envs
from vllm_disagg.v1.metrics.step_sync import (
    PREFIX,
    StepSyncCollector,
    StepSyncMetricsWriter,
    ensure_metrics_dir,
)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Two publications per rank: counters must end at the last value (the
# multiprocess exporter adds deltas), gauges too (it sets them). Rank 0 also
# runs the coordinator; "not_a_metric" must be ignored.
SNAPSHOTS = {
    0: [
        {
            "forward_steps": 3,
            "dummy_steps": 1,
            "local_step": 4,
            "coord_step": 4,
            "coordinator_grants_sent": 2,
        },
        {
            "forward_steps": 10,
            "dummy_steps": 2,
            "local_step": 12,
            "coord_step": 12,
            "coordinator_grants_sent": 9,
        },
    ],
    1: [
        {"forward_steps": 0, "dummy_steps": 4, "local_step": 4, "coord_step": 4},
        {
            "forward_steps": 5,
            "dummy_steps": 7,
            "local_step": 12,
            "coord_step": 12,
            "not_a_metric": 99,
        },
    ],
}
EXPECTED = {
    f"{PREFIX}forward_steps_total": {0: 10.0, 1: 5.0},
    f"{PREFIX}dummy_steps_total": {0: 2.0, 1: 7.0},
    f"{PREFIX}local_step": {0: 12.0, 1: 12.0},
    f"{PREFIX}coordinator_step": {0: 12.0, 1: 12.0},
    f"{PREFIX}coordinator_grants_sent_total": {0: 9.0},
}


def per_rank(exposition: str) -> dict[str, dict[int, float]]:
    """{sample name: {dp_rank: value}} of the step-sync samples."""
    found: dict[str, dict[int, float]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.startswith(PREFIX) and "dp_rank" in sample.labels:
                rank = int(sample.labels["dp_rank"])
                assert rank not in found.get(sample.name, {}), (
                    f"two {sample.name} for {rank}"
                )
                found.setdefault(sample.name, {})[rank] = sample.value
    return found


def assert_families_served_once(exposition: str) -> None:
    types = [
        line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE")
    ]
    ours = [name for name in types if name.startswith(PREFIX)]
    assert ours and len(ours) == len(set(ours)), f"a family is served twice: {ours}"


def run_python(code: str, env: dict[str, str], *arg_lists: list[str]) -> list[str]:
    """Run ``code`` once per argument list, all at once; their stdout."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for args in arg_lists or [[]]
    ]
    outputs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr[-3000:]
        outputs.append(stdout)
    return outputs


def clean_env(**extra: str) -> dict[str, str]:
    ours = (MULTIPROC_ENV, envs.VLLM_DISAGG_METRICS_DIR)
    return {**{k: v for k, v in os.environ.items() if k not in ours}, **extra}


# An engine core's part: one writer per process, as in StepSyncDPEngineCoreProc.
WRITER = """
    import json, sys
    from vllm_disagg.v1.metrics.step_sync import StepSyncMetricsWriter

    rank, snapshots = int(sys.argv[1]), json.loads(sys.argv[2])
    published = iter(snapshots)
    writer = StepSyncMetricsWriter(rank, lambda: next(published))
    for _ in snapshots[1:]:
        writer.maybe_write(force=True)
    writer.close()  # publishes the last one
"""

# An API server's part: the registry /metrics is built from, through the patch.
SERVE = """
    import sys
    from prometheus_client import generate_latest
    import vllm.entrypoints.serve.instrumentator.metrics as upstream
    from vllm_disagg.patches.entrypoints.serve.instrumentator import metrics as patch

    patch.apply()
    registry = upstream.get_prometheus_registry()
    upstream.get_prometheus_registry()  # attach_router may ask more than once
    sys.stdout.write(generate_latest(registry).decode())
"""


def test_multiprocess_mode_per_rank_series_reach_the_api_server(tmp_path):
    multiproc, snapshots_dir = tmp_path / "prometheus", tmp_path / "snapshots"
    multiproc.mkdir()
    snapshots_dir.mkdir()
    # The vllm command sets both; multiprocess mode must win.
    env = clean_env(
        **{
            MULTIPROC_ENV: str(multiproc),
            envs.VLLM_DISAGG_METRICS_DIR: str(snapshots_dir),
        }
    )
    run_python(
        WRITER, env, *([str(rank), json.dumps(s)] for rank, s in SNAPSHOTS.items())
    )
    assert sorted(p.name for p in multiproc.iterdir()), "no multiprocess files written"
    assert list(snapshots_dir.iterdir()) == [], (
        "multiprocess mode wrote JSON snapshots too"
    )

    (served,) = run_python(SERVE, env)
    assert_families_served_once(served)
    assert per_rank(served) == EXPECTED

    # What prometheus_client itself reads from the directory, independently.
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiproc))
    assert per_rank(generate_latest(registry).decode()) == EXPECTED


@pytest.fixture
def snapshot_mode(monkeypatch, tmp_path):
    """One API server: the vllm command set VLLM_DISAGG_METRICS_DIR only."""
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    monkeypatch.setenv(envs.VLLM_DISAGG_METRICS_DIR, str(tmp_path))
    return tmp_path


def test_single_api_server_snapshots_reach_the_api_server(snapshot_mode):
    for rank, snapshots in SNAPSHOTS.items():  # the JSON branch needs no fresh process
        published = iter(snapshots)
        writer = StepSyncMetricsWriter(
            rank, lambda published=published: next(published)
        )
        for _ in snapshots[1:]:
            writer.maybe_write(force=True)
        writer.close()
    files = sorted(p.name for p in snapshot_mode.iterdir())
    assert files == ["step_sync_dp0.json", "step_sync_dp1.json"]

    (served,) = run_python(
        SERVE, clean_env(**{envs.VLLM_DISAGG_METRICS_DIR: str(snapshot_mode)})
    )
    assert_families_served_once(served)  # the collector is registered once
    assert per_rank(served) == EXPECTED


def collected(directory) -> dict[str, dict[int, float]]:
    registry = CollectorRegistry()
    registry.register(StepSyncCollector(directory))
    return per_rank(generate_latest(registry).decode())


def test_writer_publishes_at_most_every_interval(snapshot_mode):
    values = {"forward_steps": 1}
    writer = StepSyncMetricsWriter(0, lambda: dict(values))
    writer.maybe_write()
    values["forward_steps"] = 2
    writer.maybe_write()  # within WRITE_INTERVAL_S of the first: skipped
    assert collected(snapshot_mode)[f"{PREFIX}forward_steps_total"] == {0: 1.0}
    writer.close()  # forced
    assert collected(snapshot_mode)[f"{PREFIX}forward_steps_total"] == {0: 2.0}


def test_every_sample_names_its_group(snapshot_mode):
    """With one ``vllm serve`` per DP rank each rank is a scrape target of
    its own: only ``dp_group`` (the coordinator's address, the same on every
    rank of a group) lets a rule compare a group's ranks across targets."""
    group = "tcp://10.0.0.1:13345"
    StepSyncMetricsWriter(1, lambda: {"local_step": 4}, dp_group=group).close()
    registry = CollectorRegistry()
    registry.register(StepSyncCollector(snapshot_mode))
    [family] = [
        f
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        if f.name == f"{PREFIX}local_step"
    ]
    [sample] = family.samples
    assert sample.labels == {"dp_rank": "1", "dp_group": group}
    assert sample.value == 4.0


def test_collector_skips_foreign_and_torn_files(snapshot_mode):
    StepSyncMetricsWriter(1, lambda: {"dummy_steps": 3}).close()
    (snapshot_mode / "step_sync_dp7.json").write_text('{"dp_rank": 7, "stats": {"dumm')
    (snapshot_mode / "step_sync_dp8.json").write_text(
        '{"dp_rank": "eight", "stats": {}}'
    )
    (snapshot_mode / "step_sync_dp9.json").write_text('["not", "a", "snapshot"]')
    assert collected(snapshot_mode) == {f"{PREFIX}dummy_steps_total": {1: 3.0}}


def test_writer_without_a_destination_does_nothing(monkeypatch):
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    monkeypatch.delenv(envs.VLLM_DISAGG_METRICS_DIR, raising=False)

    def snapshot():
        raise AssertionError("nothing to publish to, so nothing to snapshot")

    StepSyncMetricsWriter(0, snapshot).close()


PRINT_COMMAND_DIR = (
    "import os, sys\n"
    "import vllm_disagg.entrypoints.cli.main as cli\n"
    "import vllm.entrypoints.cli.main as upstream\n"
    "upstream.main = lambda: print(os.environ['VLLM_DISAGG_METRICS_DIR'])\n"
    "sys.exit(cli.main())\n"
)


def command_dirs(env: dict[str, str], times: int = 2) -> list[str]:
    """The directory the vllm command hands its children, once per run."""
    return [
        subprocess.run(
            [sys.executable, "-c", PRINT_COMMAND_DIR],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.strip()
        for _ in range(times)
    ]


def test_the_vllm_command_never_shares_an_inherited_snapshot_directory(monkeypatch):
    """A launcher that applied the patch set in-process (a test runner) has the
    variable set; servers it starts must not read each other's snapshots."""
    for name in (envs.VLLM_DISAGG_METRICS_DIR, envs.VLLM_DISAGG_METRICS_DIR_CREATED):
        monkeypatch.setenv(name, "")  # restored after the test
    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    inherited = str(ensure_metrics_dir())  # what the patch set does in the launcher
    dirs = command_dirs(dict(os.environ))
    assert inherited not in dirs
    assert dirs[0] != dirs[1] and all(dirs)


def test_the_vllm_command_uses_the_directory_its_launcher_chose(tmp_path):
    """benchmarks/step_sync_dp.py gives each server its own directory and reads
    the probe counts there: the command must hand that one to its children
    (created if missing), whatever the launcher's own patch set created."""
    chosen = tmp_path / "chosen" / "metrics"
    env = clean_env(
        **{
            envs.VLLM_DISAGG_METRICS_DIR: str(chosen),
            envs.VLLM_DISAGG_METRICS_DIR_CREATED: str(tmp_path / "launchers-own"),
        }
    )
    assert command_dirs(env) == [str(chosen)] * 2
    assert chosen.is_dir()
