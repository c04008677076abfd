"""A pytest plugin for runs of upstream vLLM's own tests (``-p`` of
:mod:`vllm_disagg.testing.upstream`): it loads vLLM's general plugins the way
every vLLM process does, refuses to run unless the mode asked for is the one in
effect, and writes each test's outcome to a JSON-lines file as it ends.

Modes (``--upstream-mode``):

* ``plugin``: vllm_disagg is loaded and every enabler and feature patch is
  applied in the pytest process;
* ``enablers``: vllm_disagg is loaded with ``VLLM_DISAGG_DISABLE=1``: the
  enablers are applied, no feature patch is;
* ``off``: vLLM's plugin filter (``VLLM_PLUGINS``) leaves vllm_disagg out: no
  module of its patch set is imported, checked again at the end of the session.

In every mode the ``vllm`` imported is the installed one, not the sdist's
source (only its tests are extracted).

Loading the general plugins at the start matters for tests that never build
``EngineArgs`` (which loads them): without it a platform or sampler test would
run against unpatched vLLM in every mode and compare nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

MODES = ("plugin", "enablers", "off")
# Modules that exist in a process only once the patch set was loaded.
_PATCH_SET_MODULES = ("vllm_disagg.plugin", "vllm_disagg.patches")
# A failing test's report, cut to this many characters in the results file.
_LONGREPR_CHARS = 3000


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm_disagg upstream tests")
    group.addoption("--upstream-mode", choices=MODES, help="the mode to check")
    group.addoption(
        "--upstream-results", help="JSON-lines file each test's outcome goes to"
    )


def _mode_problem(mode: str) -> str | None:
    """Why the process is not in ``mode``, or None when it is."""
    import vllm
    from vllm.plugins import load_general_plugins

    site = Path(vllm.__file__).resolve().parent.parent
    if site.name not in ("site-packages", "dist-packages"):
        return f"vllm is imported from {vllm.__file__}, not from the installed wheel"
    load_general_plugins()
    loaded = [name for name in _PATCH_SET_MODULES if name in sys.modules]
    if mode == "off":
        return f"plugins are off but {loaded} were imported" if loaded else None
    if len(loaded) != len(_PATCH_SET_MODULES):
        return f"vllm_disagg's patch set was not loaded (VLLM_PLUGINS={_plugins()})"
    from vllm_disagg.patches import PATCHES, verify_applied

    status = verify_applied()
    not_in_place = sorted(name for name, ok in status.items() if not ok)
    if not_in_place:
        return f"patches applied but not in place: {not_in_place}"
    kinds = {p.name: p.kind for p in PATCHES}
    applied = set(status)
    enablers = {name for name, kind in kinds.items() if kind == "enabler"}
    features = {name for name, kind in kinds.items() if kind == "feature"}
    if enablers - applied:
        return f"enablers not applied: {sorted(enablers - applied)}"
    if mode == "plugin" and features - applied:
        return f"features not applied: {sorted(features - applied)}"
    if mode == "enablers" and features & applied:
        both = sorted(features & applied)
        return f"features applied with VLLM_DISAGG_DISABLE: {both}"
    return None


def _plugins() -> str:
    value = os.environ.get("VLLM_PLUGINS")
    return "unset" if value is None else repr(value)


class _Recorder:
    def __init__(self, path: Path, mode: str) -> None:
        self.path = path
        self.mode = mode
        self.phases: dict[str, list] = {}
        self.started: dict[str, float] = {}
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.started[nodeid] = time.monotonic()
        self.write({"start": nodeid})

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.phases.setdefault(report.nodeid, []).append(report)
        if report.when != "teardown":
            return
        reports = self.phases.pop(report.nodeid)
        outcome, longrepr = _outcome(reports)
        record = {
            "test": report.nodeid,
            "outcome": outcome,
            "seconds": round(
                time.monotonic() - self.started.pop(report.nodeid, time.monotonic()),
                2,
            ),
        }
        if longrepr:
            record["longrepr"] = longrepr[-_LONGREPR_CHARS:]
        self.write(record)

    @pytest.hookimpl
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.write(
                {
                    "test": report.nodeid,
                    "outcome": "error",
                    "collect": True,
                    "longrepr": str(report.longrepr)[-_LONGREPR_CHARS:],
                }
            )

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus) -> None:
        record = {"session": "finished", "exitstatus": int(exitstatus)}
        if self.mode == "off":
            loaded = [name for name in _PATCH_SET_MODULES if name in sys.modules]
            if loaded:
                record["problem"] = f"plugins are off but {loaded} were imported"
        self.write(record)
        self.file.close()


def _outcome(reports: list[pytest.TestReport]) -> tuple[str, str | None]:
    """One test's outcome from its setup, call and teardown reports:
    passed, failed, error (setup or teardown failed), skipped, xfailed or
    xpassed; and the report of what failed."""
    by_when = {r.when: r for r in reports}
    setup, call = by_when.get("setup"), by_when.get("call")
    teardown = by_when.get("teardown")
    if setup is not None and setup.failed:
        return "error", str(setup.longrepr)
    if setup is not None and setup.skipped:
        return ("xfailed" if hasattr(setup, "wasxfail") else "skipped"), None
    if call is not None:
        if hasattr(call, "wasxfail"):
            return ("xpassed" if call.passed else "xfailed"), None
        if call.failed:
            return "failed", str(call.longrepr)
        if call.skipped:
            return "skipped", None
    if teardown is not None and teardown.failed:
        return "error", str(teardown.longrepr)
    return "passed", None


def pytest_configure(config: pytest.Config) -> None:
    mode = config.getoption("--upstream-mode")
    results = config.getoption("--upstream-results")
    if mode is None or results is None:
        raise pytest.UsageError("--upstream-mode and --upstream-results are needed")
    problem = _mode_problem(mode)
    recorder = _Recorder(Path(results), mode)
    recorder.write({"session": "started", "mode": mode, "problem": problem})
    if problem:
        recorder.file.close()
        pytest.exit(f"not in mode {mode!r}: {problem}", returncode=3)
    config.pluginmanager.register(recorder, "vllm_disagg_upstream_recorder")
