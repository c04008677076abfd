"""Every module of the package imports on its own, and no two import each other.

Cycles are looked for statically, over every import statement (those inside
functions too: a lazy import only moves a cycle to run time) except type-only
ones; importing a package's own ancestors is not an edge, as Python has
already started those. The import check runs every module in one fresh
interpreter, with every ``vllm_disagg`` module dropped from ``sys.modules``
before each one, so a module that only imports after another one did fails.
"""

from __future__ import annotations

import ast
import graphlib
import json
import subprocess
import sys
from pathlib import Path

import vllm_disagg

PACKAGE = Path(vllm_disagg.__file__).resolve().parent


# Files the export writes into vLLM's tree: data here, not modules of the
# package (they import vLLM's test helpers, or names the export adds to vLLM,
# which only that tree has).
DATA = (PACKAGE / "export" / "upstream_tests", PACKAGE / "export" / "upstream_src")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: name -> (path, is a package)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(data in path.parents for data in DATA):
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imports(name: str, path: Path, is_package: bool, modules) -> set[str]:
    """The package's modules that ``name`` imports anywhere, but under
    ``TYPE_CHECKING``."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
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
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {
        t
        for t in targets
        if t in modules and t != name and not name.startswith(t + ".")
    }


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, *where, modules) for name, where in modules.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


_IMPORT_EACH = """
import importlib, json, sys, traceback
failed = {}
for name in json.loads(sys.argv[1]):
    for loaded in [
        m for m in sys.modules if m == "vllm_disagg" or m.startswith("vllm_disagg.")
    ]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def test_every_module_imports_alone():
    names = sorted(_modules())
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{name}:\n{tb}" for name, tb in failed.items())


def test_every_name_a_package_exports_exists():
    """``__all__`` is the public surface: each name in it must resolve (a
    package whose surface is its modules names them)."""
    import importlib
    import importlib.util

    missing = {}
    for name, (path, is_package) in _modules().items():
        if not is_package or "__all__" not in path.read_text():
            continue
        module = importlib.import_module(name)
        absent = [
            n
            for n in module.__all__
            if not hasattr(module, n)
            and importlib.util.find_spec(f"{name}.{n}") is None
        ]
        if absent:
            missing[name] = absent
    assert not missing, missing
