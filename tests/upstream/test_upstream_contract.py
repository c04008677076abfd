"""Upstream vLLM's own tests are the contract: with vllm_disagg installed and
loaded, every test of the CI set that passes with plugins off (the committed
baseline) still passes. See docs/upstream_tests.md.

The end-to-end test runs ``scripts/upstream_tests.py`` (the pinned sdist's
tests, downloaded from PyPI into the export's cache on first use, against the
installed wheel); the others check the runner, the probe and the baseline
without running upstream's tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_disagg import envs
from vllm_disagg.export.source import Pin
from vllm_disagg.testing import upstream
from vllm_disagg.testing.upstream import CI, FULL, SETS, Run, baseline_path, compare

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "upstream_tests.py"


@pytest.mark.e2e
def test_upstream_ci_set_passes_with_the_plugin(tmp_path):
    """The CI set with the plugin loaded: no test of the baseline fails
    (a few minutes on 2 cores; the first run also downloads the sdist)."""
    out = tmp_path / "run.json"
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--set", "ci", "--json", str(out)],
            capture_output=True,
            text=True,
            timeout=CI.timeout_s + 900,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"scripts/upstream_tests.py did not finish in {exc.timeout} s")
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-4000:]
    run = json.loads(out.read_text())
    assert run["mode"] == "plugin" and run["problem"] is None
    baseline = json.loads(baseline_path().read_text())["sets"]["ci"]
    assert len(run["outcomes"]) >= len(baseline["passed"]) > 0


# Upstream tests that fail upstream on CPU and that an enabler makes pass
# (issue 33): run by name, no baseline to compare with.
FIXED_BY_ENABLERS = {
    # MoE with expert parallelism, DP=2, pause and resume: upstream's CPU
    # experts ignore expert_map (cpu-moe-expert-map); about 2 min on 2 cores.
    "tests/v1/distributed/test_async_llm_dp.py::test_dp_pause_resume_basic[True]": (
        "cpu-moe-expert-map"
    ),
}


@pytest.mark.e2e
@pytest.mark.parametrize("nodeid", sorted(FIXED_BY_ENABLERS))
def test_upstream_tests_an_enabler_fixed_pass_with_the_plugin(nodeid, tmp_path):
    out = tmp_path / "run.json"
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--paths", nodeid, "--json", str(out)],
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{nodeid} did not finish in {exc.timeout} s")
    assert out.is_file(), done.stdout[-12000:] + done.stderr[-4000:]
    run = json.loads(out.read_text())
    assert run["outcomes"] == {nodeid: "passed"}, (
        done.stdout[-12000:] + done.stderr[-4000:]
    )


# The baseline as committed.


def test_baseline_is_of_the_pinned_sdist_and_the_sets_as_defined():
    pin = Pin.current()
    data = json.loads(baseline_path(pin).read_text())
    assert data["vllm"] == pin.version
    assert data["sdist_sha256"] == pin.sdist_sha256, (
        "the pin changed: regenerate the baseline "
        "(scripts/upstream_tests.py --baseline --set NAME)"
    )
    assert data["mode"] == "off"
    # The CI set's baseline is committed; the larger set's may be (without
    # one, a run of it takes its own baseline first, plugins off).
    assert "ci" in data["sets"] and set(data["sets"]) <= set(SETS)
    for name, entry in data["sets"].items():
        test_set = SETS[name]
        assert entry["paths"] == list(test_set.paths), (
            f"set {name} changed since its baseline: regenerate it"
        )
        assert entry["deselected"] == sorted({**upstream.DESELECT, **test_set.deselect})
        assert entry["passed"] == sorted(set(entry["passed"]))
        assert not set(entry["passed"]) & set(entry["not_passed"])
        for nodeid in entry["passed"]:
            assert upstream.in_paths(nodeid, test_set.paths), nodeid
    # The CI set is a part of the larger one.
    if "full" in data["sets"]:
        full = set(data["sets"]["full"]["passed"])
        assert set(data["sets"]["ci"]["passed"]) <= full
    assert all(upstream.in_paths(p, FULL.paths) for p in CI.paths)


def test_every_deselected_test_says_why():
    for test_set in SETS.values():
        for nodeid, why in {**upstream.DESELECT, **test_set.deselect}.items():
            assert nodeid.startswith("tests/") and why.strip(), nodeid


# The runner.


def test_plugins_off_leaves_out_only_this_package(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_PLUGINS", "vllm_disagg")
    monkeypatch.setenv("HF_TOKEN", "x")
    monkeypatch.setenv(envs.VLLM_DISAGG_PROBE, "1")
    names = upstream.other_plugin_names()
    assert "vllm_disagg" not in names
    off = upstream.mode_env("off", tmp_path)
    assert off["VLLM_PLUGINS"] == ",".join(names)
    assert "vllm_disagg" not in off["VLLM_PLUGINS"].split(",")
    plugin = upstream.mode_env("plugin", tmp_path)
    assert "VLLM_PLUGINS" not in plugin and envs.VLLM_DISAGG_DISABLE not in plugin
    enablers = upstream.mode_env("enablers", tmp_path)
    assert enablers[envs.VLLM_DISAGG_DISABLE] == "1"
    for env in (off, plugin, enablers):
        # One sealed environment: offline, its own Hub cache, nothing of ours.
        assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HOME"] == str(tmp_path)
        assert "HF_TOKEN" not in env and envs.VLLM_DISAGG_PROBE not in env


def _run(outcomes: dict[str, str], problem: str | None = None) -> Run:
    return Run("plugin", "ci", outcomes, {}, {}, 1.0, problem)


def test_compare_names_what_no_longer_passes():
    pin = Pin.current()
    baseline = {
        "sdist_sha256": pin.sdist_sha256,
        "sets": {
            "ci": {
                "paths": list(CI.paths),
                "passed": ["tests/a.py::ok", "tests/a.py::gone", "tests/a.py::bad"],
            }
        },
    }
    run = _run(
        {
            "tests/a.py::ok": "passed",
            "tests/a.py::bad": "error",
            "tests/b.py::new": "passed",
        }
    )
    result = compare(run, baseline, CI)
    assert result.compared == 3
    assert result.regressions == {
        "tests/a.py::gone": "not run",
        "tests/a.py::bad": "error",
    }
    assert result.only_here == ["tests/b.py::new"]
    assert result.problem is None
    stale = {**baseline, "sdist_sha256": "0" * 64}
    assert "regenerate" in compare(run, stale, CI).problem


def test_probe_records_each_outcome_and_refuses_a_wrong_mode(tmp_path):
    """The probe in a pytest run of a few made-up tests, plugins off."""
    (tmp_path / "test_some.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip(reason='x')\n"
        "def test_skip(): pass\n"
        "@pytest.mark.xfail\n"
        "def test_xfail(): assert False\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('setup')\n"
        "def test_error(broken): pass\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_param(x): assert x == 1\n"
    )

    def probe(mode: str, env_mode: str):
        results = tmp_path / f"{mode}-{env_mode}.jsonl"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                upstream.PROBE,
                f"--upstream-mode={mode}",
                f"--upstream-results={results}",
                "-p",
                "no:cacheprovider",
                "-q",
                str(tmp_path / "test_some.py"),
            ],
            cwd=tmp_path,
            env=upstream.mode_env(env_mode, tmp_path / "hf"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        return done, upstream._read_results(results, mode, "t", 0.0, None)

    done, run = probe("off", "off")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert run.problem is None
    assert {k.split("::")[1]: v for k, v in run.outcomes.items()} == {
        "test_ok": "passed",
        "test_bad": "failed",
        "test_skip": "skipped",
        "test_xfail": "xfailed",
        "test_error": "error",
        "test_param[1]": "passed",
        "test_param[2]": "failed",
    }
    assert "assert False" in next(v for k, v in run.reports.items() if "bad" in k)
    # Asked for the plugin's mode with plugins off: refused before any test.
    done, run = probe("plugin", "off")
    assert done.returncode == 3, done.stdout[-3000:]
    assert "patch set was not loaded" in run.problem and not run.outcomes
