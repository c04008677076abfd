"""Every benchmark checks its dependencies before it starts (benchmarks/_deps.py).

A missing module (matplotlib, say) must end a benchmark at once with one line
naming it and the install command, not as a traceback at the plot after ten
minutes of measurement; and requirements/bench.txt must list every module the
benchmarks ask for.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
BENCH_REQUIREMENTS = ROOT / "requirements" / "bench.txt"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
COMMON = BENCHMARKS / "common"
# Imports that are no benchmark dependency: this package, the helpers in
# benchmarks/ (_deps.py, common/), and what the target's requirements install
# (requirements/cpu.txt, cuda.txt).
NOT_BENCH_DEPS = {"vllm_disagg", "_deps", "common", "torch", "vllm"}


def _load_deps():
    spec = importlib.util.spec_from_file_location("bench_deps", BENCHMARKS / "_deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _main(tree: ast.Module) -> ast.FunctionDef:
    mains = [
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"
    ]
    assert len(mains) == 1, "a benchmark has one top-level main()"
    return mains[0]


def _require_call(stmt: ast.stmt) -> ast.Call | None:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        if isinstance(func, ast.Name) and func.id == "require":
            return stmt.value
    return None


def _is_parse_args(stmt: ast.stmt) -> bool:
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "parse_args"
        for node in ast.walk(stmt)
    )


def _imported_modules(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _bench_requirement_names() -> set[str]:
    names = set()
    for line in BENCH_REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.add(
                re.split(r"[\s<>=!~;\[]", line, maxsplit=1)[0].lower().replace("-", "_")
            )
    return names


def _required(path: Path) -> list[str]:
    """The modules main() passes to require(), checking where it calls it."""
    main = _main(ast.parse(path.read_text()))
    calls = [(i, c) for i, stmt in enumerate(main.body) if (c := _require_call(stmt))]
    assert len(calls) == 1, (
        f"{path.name}: main() calls require(...) from benchmarks/_deps.py once, as a "
        "statement of its own body (not inside an if or a loop)"
    )
    index, call = calls[0]
    parsed = [i for i, stmt in enumerate(main.body) if _is_parse_args(stmt)]
    assert parsed and index == parsed[0] + 1, (
        f"{path.name}: require(...) comes right after parse_args(), before any work"
    )
    assert all(
        isinstance(a, ast.Constant) and isinstance(a.value, str) for a in call.args
    )
    return [a.value for a in call.args]


def test_there_are_benchmarks():
    assert len(SCRIPTS) >= 4, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_checks_every_module_it_imports_first(path):
    required = _required(path)
    third_party = {
        name
        for name in _imported_modules(ast.parse(path.read_text()))
        if name not in sys.stdlib_module_names and name not in NOT_BENCH_DEPS
    }
    assert third_party <= set(required), (
        f"{path.name} imports {sorted(third_party - set(required))} without naming "
        "them in its require(...) call"
    )


# This project's modules that benchmarks/common/ may import at module level:
# each imports only the standard library itself (checked below).
STDLIB_ONLY_PROJECT_MODULES = (ROOT / "vllm_disagg" / "testing" / "process.py",)


def _module_level_third_party(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    top = ast.Module(
        body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))],
        type_ignores=[],
    )
    return {
        name
        for name in _imported_modules(top)
        if name not in sys.stdlib_module_names and name not in {"_deps", "common"}
    }


@pytest.mark.parametrize(
    "path",
    [*sorted(COMMON.glob("*.py")), *STDLIB_ONLY_PROJECT_MODULES],
    ids=lambda p: p.name,
)
def test_common_imports_only_the_standard_library_at_module_level(path):
    """benchmarks/common/ is imported before a script's require(...) runs: a
    third-party module it needs is imported inside the function that uses it.
    Of this project, only the stdlib-only modules listed above."""
    allowed = {"vllm_disagg"} if path.is_relative_to(COMMON) else set()
    third_party = _module_level_third_party(path) - allowed
    assert not third_party, f"{path.name} imports {sorted(third_party)} at module level"


def test_bench_requirements_list_every_required_module():
    required = {name for path in SCRIPTS for name in _required(path)}
    assert required, "no benchmark requires anything: the check is pointless"
    missing = required - _bench_requirement_names()
    assert not missing, f"add {sorted(missing)} to requirements/bench.txt"


def test_require_passes_when_everything_imports(capsys):
    _load_deps().require("json", "psutil")
    assert capsys.readouterr().err == ""


def test_require_exits_2_with_one_line_naming_every_missing_module(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["some_bench.py"])
    deps = _load_deps()
    with pytest.raises(SystemExit) as exited:
        deps.require("json", "no_such_module_for_vllm_disagg", "another_missing_module")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        "some_bench.py: missing Python modules no_such_module_for_vllm_disagg, "
        "another_missing_module; "
    ), err
    assert "-m pip install -r " in err and "requirements/bench.txt" in err


SITECUSTOMIZE = """\
import subprocess
import sys

sys.modules["matplotlib"] = None


class NoChildren(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        raise RuntimeError(f"the benchmark went on past its dependency check: {args}")


subprocess.Popen = NoChildren
"""


def test_benchmark_with_matplotlib_missing_exits_at_once(tmp_path):
    """The run that once crashed after 10 minutes: step_sync_dp.py without
    matplotlib."""
    hide = tmp_path / "hide"
    hide.mkdir()
    # None in sys.modules makes `import matplotlib` raise ImportError. And no
    # child process may start: should the check not stop the run, it fails at
    # its first server, not minutes later with servers left behind.
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(hide), env.get("PYTHONPATH")])
    )
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "step_sync_dp.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    python = os.path.relpath(sys.executable, ROOT)
    if python.startswith(os.pardir):
        python = sys.executable
    assert proc.stderr.splitlines() == [
        "step_sync_dp.py: missing Python module matplotlib; install the benchmark "
        f"requirements with: {python} -m pip install -r requirements/bench.txt"
    ]
    # Imports only: no tiny model built, no server started (those take minutes).
    assert took < 60, f"took {took:.0f} s"
