"""The P2P package's modules import each other in one direction only.

Stricter than tests/test_imports.py: imports under ``TYPE_CHECKING`` count
too (a type-only import back into a module is still a circle in the design:
engine/ports.py's Protocols are what a thread's module names instead), and
so do imports inside functions. Importing a package's own ancestors is not
an edge: Python has already started those.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from vllm_disagg.distributed.kv_transfer.kv_connector.v1 import p2p

ROOT = Path(p2p.__file__).resolve().parent
NAME = p2p.__name__
ENGINE = f"{NAME}.engine"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the p2p package: name -> (path, is a package)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        parts = parts[:-1] if is_package else parts
        found[".".join([NAME, *parts])] = (path, is_package)
    return found


def _imports(name: str, path: Path, is_package: bool, modules) -> set[str]:
    """The p2p modules ``name`` imports anywhere, type-only imports included."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + [base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
    return {
        t
        for t in targets
        if t in modules and t != name and not name.startswith(t + ".")
    }


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, *where, modules) for name, where in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def test_the_p2p_import_graph_is_acyclic():
    cycle = _cycle(_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_checker_sees_a_type_only_cycle(tmp_path, monkeypatch):
    # The check itself: a TYPE_CHECKING import back is a cycle here.
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from pkg import b\n")
    b.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    modules = {"pkg.a": (a, False), "pkg.b": (b, False)}
    graph = {n: _imports(n, *where, modules) for n, where in modules.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert _cycle(graph) is not None


@pytest.mark.parametrize("module", ["peer", "inbound", "receiver", "sender"])
def test_the_engine_threads_and_sides_never_name_the_engine(module):
    """They talk to it through engine/ports.py, not by importing core.py."""
    graph = _graph()
    assert f"{ENGINE}.core" not in graph[f"{ENGINE}.{module}"]


def test_the_transfer_core_is_pure():
    """The state tables import no engine module, thread or socket library."""
    for module in ("recv_state", "send_state"):
        path = ROOT / f"{module}.py"
        tree = ast.parse(path.read_text())
        names = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        }
        assert not names & {"threading", "zmq", "socket", "torch", "time"}, module
        assert not {t for t in _graph()[f"{NAME}.{module}"] if t.startswith(ENGINE)}
