"""The project's modules at their upstream paths: imports, names and text rewritten.

:func:`relocate` reads the project files of one slice (:mod:`.layout`) and
returns each file's upstream path and final text. Per file (libcst):

* imports of project modules, module by module and name by name (absolute and
  relative ones): moved modules get their upstream name, ``init_logger`` comes
  from ``vllm.logger``, ``ConfigError`` becomes ``ValueError``, ``from
  vllm_disagg import envs`` becomes ``import vllm.envs as envs`` (a variable's
  name constant becomes its in-tree name as a string, an accessor call
  ``envs.p2p_secret()`` becomes ``envs.VLLM_P2P_NCCL_SECRET``); inside an
  example package and between sibling tests, imports become relative;
* strings, docstrings and comments: literal substitutions (store keys, the
  metric prefix, wire labels), ``VLLM_DISAGG_*`` names, module paths
  (``vllm_disagg/wire/peers.py``) and dotted module names;
* upstream's forbidden imports (``re`` -> ``regex as re``, ``base64`` ->
  ``pybase64 as base64``), test markers (``cpu_test`` on unit tests, the
  project-only ``e2e`` dropped), the SPDX header.

Whatever still names the project afterwards (``vllm_disagg``, ``vllm-disagg``,
``VLLM_DISAGG``, any case), and every import of a dropped module, refuses the
export with an :class:`~vllm_disagg.export.source.ExportError` naming
``file:line``: nothing is kept silently.

The parts: :mod:`.module_map` (which file goes where, what a project name
becomes), :mod:`.rewriter` (code and text of one file), :mod:`.module_edits`
(kept names, pruned imports, markers, SPDX) and :mod:`.envs_file`
(vllm/envs.py); this module runs them over a slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import MetadataWrapper

from vllm_disagg.export import layout as L
from vllm_disagg.export.envs_file import add_env_vars
from vllm_disagg.export.module_edits import (
    SPDX,
    add_spdx,
    asyncio_marks,
    dedupe_env_import,
    markers,
    select,
)
from vllm_disagg.export.module_map import FileJob, ModuleMap, plan
from vllm_disagg.export.rewriter import Rewriter, TextRewriter
from vllm_disagg.export.source import ExportError

__all__ = [
    "LEFTOVER",
    "SPDX",
    "FileJob",
    "ModuleMap",
    "Relocation",
    "add_env_vars",
    "plan",
    "problems_of",
    "relocate",
    "rewrite_file",
]

# Anything that still names the project after the rewrite.
LEFTOVER = re.compile(r"vllm[_\-. ]?disagg", re.IGNORECASE)


@dataclass
class Relocation:
    """A slice's files at their upstream paths, and what else the tree needs."""

    slice: str
    files: dict[str, str]  # tree-relative path -> final text
    sources: dict[str, str]  # tree-relative path -> project-relative path
    env_vars: tuple[L.EnvVar, ...]  # to declare in vllm/envs.py
    dropped: dict[str, str] = field(default_factory=dict)  # project path/name -> why
    # Files an earlier slice wrote that this one replaces (a conftest.py that
    # gains fixtures); every other file is new to the tree.
    replaces: tuple[str, ...] = ()


# --- the slice ------------------------------------------------------------------------


def _hook(table: dict[str, str], slice_name: str):
    """A slice's function named in layout (``"module:function"``), or None."""
    import importlib

    spec = table.get(slice_name)
    if spec is None:
        return None
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def source_text(root: Path, job: FileJob) -> str:
    """A project file's text as the relocation reads it: with its literal
    replacements (layout.SOURCE_TEXT) and its slice's rewrites of the project
    source (layout.PRE_REWRITE) applied first."""
    text = (root / job.source).read_text(encoding="utf-8")
    for old, new in L.SOURCE_TEXT.get(job.source, ()):
        if text.count(old) != 1:
            raise ExportError(
                f"{job.source}: layout.SOURCE_TEXT expects {old[:60]!r} once, "
                f"found {text.count(old)} times"
            )
        text = text.replace(old, new)
    pre = _hook(L.PRE_REWRITE, job.slice)
    return text if pre is None else pre(job.module, job.source, text)


def rewrite_file(
    source: str, job: FileJob, modules: ModuleMap, slice_name: str
) -> tuple[str, list[str], set[str]]:
    """A file's final text (before formatting), its problems, the in-tree
    env vars it reads."""
    env_names = {v.project: v.name for v in L.ENV_VARS}
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        return source, [f"{job.source}: does not parse ({exc.message})"], set()
    module, problems = select(module, job)
    module = markers(module, job)
    module = asyncio_marks(module, job)
    wrapper = MetadataWrapper(module)
    rewriter = Rewriter(job, modules, TextRewriter(modules, env_names), slice_name)
    # Bindings first (a use may come before its import, e.g. under TYPE_CHECKING).
    wrapper.module.visit(_BindingScan(rewriter))
    new = wrapper.visit(rewriter)
    problems += rewriter.problems
    code = dedupe_env_import(new.code, rewriter.bindings.env)
    for number, line in enumerate(code.splitlines(), 1):
        if LEFTOVER.search(line):
            problems.append(
                f"{job.target}:{number}: still names the project: {line.strip()[:120]}"
            )
    return add_spdx(code), problems, rewriter.env_used


class _BindingScan(cst.CSTVisitor):
    def __init__(self, rewriter: Rewriter):
        self.rewriter = rewriter

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        module = self.rewriter._absolute(node)
        if isinstance(node.names, cst.ImportStar):
            return
        for alias in node.names:
            name = get_full_name_for_node(alias.name) or ""
            local = alias.asname.name.value if alias.asname else name  # type: ignore[union-attr]
            resolved = self.rewriter.modules.resolve(
                f"{module}.{name}" if module else name
            )
            if resolved is None:
                continue
            if resolved.env:
                self.rewriter.bindings.env.add(local)
            elif resolved.noop:
                self.rewriter.bindings.noop[local] = resolved.noop
            elif resolved.builtin:
                self.rewriter.bindings.builtins[local] = resolved.name or ""


def format_code(files: dict[str, str], config: Path | None) -> dict[str, str]:
    """``ruff format`` (and the import-sorting fix) with upstream's config."""
    import shutil
    import subprocess
    import sys
    import tempfile

    ruff = str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        ruff = shutil.which("ruff") or ""
    if not ruff:
        raise ExportError("ruff is not installed: pip install -e '.[export]'")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
        # Upstream's isort sees vllm/ and tests/ as first-party (its source
        # root); the scratch directory holds only the slice's files.
        first_party = ["--config", "lint.isort.known-first-party = ['vllm', 'tests']"]
        args = (
            ["--config", str(config)]
            if config
            else ["--isolated", "--line-length", "88"]
        )
        args += first_party
        paths = [str(root / rel) for rel in files]
        subprocess.run(
            [
                ruff,
                "check",
                "--quiet",
                "--fix",
                "--select",
                "I",
                "--exit-zero",
                *args,
                *paths,
            ],
            check=True,
            capture_output=True,
            cwd=root,
        )
        done = subprocess.run(
            [ruff, "format", "--quiet", *args, *paths],
            capture_output=True,
            text=True,
            cwd=root,
        )
        if done.returncode != 0:
            raise ExportError(
                f"ruff format failed: {done.stderr.strip().splitlines()[-1:]}"
            )
        return {rel: (root / rel).read_text() for rel in files}


def relocate(
    project_root: Path,
    slice_name: str,
    *,
    ruff_config: Path | None = None,
    format: bool = True,
) -> Relocation:
    """The slice's files at their upstream paths, rewritten and formatted.

    ``ruff_config``: the tree's pyproject.toml (upstream's line length and
    rules); without it ruff formats at 88 columns. Raises ExportError on any
    unresolved reference, naming the first and how many more."""
    if slice_name not in L.SLICES:
        raise ExportError(f"unknown slice {slice_name!r}; one of {', '.join(L.SLICES)}")
    root = Path(project_root)
    jobs = plan(root)
    modules = ModuleMap(jobs)
    files: dict[str, str] = {}
    sources: dict[str, str] = {}
    problems: list[str] = []
    env_used: set[str] = set()
    for job in jobs:
        if job.slice != slice_name:
            continue
        if not job.source:
            files[job.target] = add_spdx(
                f'"""Helpers of the {L.P2P.rsplit(".", 1)[1]} tests."""\n'
            )
            sources[job.target] = ""
            continue
        try:
            text = source_text(root, job)
        except ExportError as exc:
            problems.append(str(exc))
            continue
        code, found, used = rewrite_file(text, job, modules, slice_name)
        files[job.target] = code
        sources[job.target] = job.source
        problems += found
        env_used |= used
    new_files = _hook(L.NEW_FILES, slice_name)
    for rel, text in (new_files() if new_files else {}).items():
        if rel in files:
            problems.append(f"{rel}: written by the slice and relocated too")
        files[rel] = add_spdx(text)
        sources[rel] = ""
    for package in _missing_packages(files, slice_name, jobs):
        files[package] = SPDX
        sources[package] = ""
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ExportError(f"{slice_name}: unresolved: {problems[0]}{more}")
    if format:
        files = format_code(files, ruff_config)
    dropped = {f"{p}::{n}": why for (p, n), why in L.DROPPED_TESTS.items()}
    # A slice declares its own variables and those of later slices it reads;
    # an earlier slice's are in vllm/envs.py already.
    order = L.SLICES.index(slice_name)
    env_vars = tuple(
        v
        for v in L.ENV_VARS
        if v.slice == slice_name
        or (v.name in env_used and L.SLICES.index(v.slice) > order)
    )
    earlier = {
        j.target for j in jobs if L.SLICES.index(j.slice) < L.SLICES.index(slice_name)
    }
    replaces = tuple(sorted(set(files) & earlier))
    return Relocation(slice_name, files, sources, env_vars, dropped, replaces)


# Test directories that need an __init__.py for their relative imports and for
# `tests.<path>` imports; upstream already has these ones.
UPSTREAM_TEST_PACKAGES = {
    "tests",
    "tests/v1",
    "tests/v1/kv_connector",
    "tests/v1/kv_connector/unit",
    "tests/v1/engine",
    "tests/v1/distributed",
    "tests/distributed",
}


def _missing_packages(
    files: dict[str, str], slice_name: str, jobs: list[FileJob]
) -> list[str]:
    earlier = {
        j.target for j in jobs if L.SLICES.index(j.slice) < L.SLICES.index(slice_name)
    }
    # Directories an earlier slice wrote files in: it added their __init__.py.
    earlier_dirs = {
        "/".join(parts[:end])
        for parts in (t.split("/") for t in earlier)
        for end in range(1, len(parts))
    }
    out = []
    for rel in files:
        if not rel.startswith("tests/"):
            continue
        directory = rel.rsplit("/", 1)[0]
        while directory not in UPSTREAM_TEST_PACKAGES and directory:
            init = f"{directory}/__init__.py"
            if (
                init not in files
                and init not in earlier
                and directory not in earlier_dirs
                and init not in out
            ):
                out.append(init)
            directory = directory.rsplit("/", 1)[0] if "/" in directory else ""
    return sorted(out)


def problems_of(project_root: Path, slice_name: str) -> list[str]:
    """Every unresolved reference of a slice (for development; relocate
    raises on the first)."""
    root = Path(project_root)
    jobs = plan(root)
    modules = ModuleMap(jobs)
    out: list[str] = []
    for job in jobs:
        if job.slice == slice_name and job.source:
            try:
                text = source_text(root, job)
            except ExportError as exc:
                out.append(str(exc))
                continue
            out += rewrite_file(text, job, modules, slice_name)[1]
    return out
