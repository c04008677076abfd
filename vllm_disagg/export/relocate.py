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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import MetadataWrapper, PositionProvider

from vllm_disagg.export import layout as L
from vllm_disagg.export.source import ExportError

SPDX = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
PROJECT = "vllm_disagg"
# Anything that still names the project after the rewrite.
LEFTOVER = re.compile(r"vllm[_\-. ]?disagg", re.IGNORECASE)
_DOTTED = re.compile(r"(?<![\w.])vllm_disagg(?:\.[A-Za-z_]\w*)*")
_PATH = re.compile(r"(?<![\w/])vllm_disagg(?:/[A-Za-z_]\w*)+(?:\.py)?")
_ENV = re.compile(r"\bVLLM_DISAGG_[A-Z0-9_]+\b")
# Upstream's forbidden imports (tools/pre_commit/check_forbidden_imports.py)
# that have a drop-in replacement: module -> (module, asname).
FORBIDDEN = {"re": ("regex", "re"), "base64": ("pybase64", "base64")}


@dataclass(frozen=True)
class FileJob:
    """One project file and where it goes."""

    source: str  # project-relative path
    target: str  # tree-relative path
    module: str  # its project module name (tests: tests.a.b)
    upstream: str  # its module name in the tree
    slice: str
    kind: str  # "library", "example", "test" or "helper"
    unit: bool = False
    keep: tuple[str, ...] | None = None  # only these top-level names (conftest split)
    drop: tuple[str, ...] = ()  # top-level names not exported
    annotations: tuple[tuple[str, str], ...] = ()  # kept variable -> new annotation


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


# --- the module map ------------------------------------------------------------


def _module_of(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_package(job: FileJob) -> bool:
    return job.target.endswith("/__init__.py")


def plan(project_root: Path) -> list[FileJob]:
    """Every exported file of every slice, in slice order."""
    root = Path(project_root)
    jobs: list[FileJob] = []
    for move in L.MOVES:
        base = root / move.project.replace(".", "/")
        if not base.is_dir():  # one module to one file
            source = base.with_suffix(".py").relative_to(root).as_posix()
            if not move.path.endswith(".py") or not (root / source).is_file():
                raise ExportError(
                    f"layout: {move.project} -> {move.path}: no such module"
                )
            kind = "example" if move.relative else "library"
            jobs.append(
                FileJob(
                    source, move.path, move.project, move.upstream, move.slice, kind
                )
            )
            continue
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(base).as_posix()
            source = path.relative_to(root).as_posix()
            target = f"{move.path}/{rel}"
            sub = _module_of(rel)
            upstream = move.upstream + (f".{sub}" if sub else "")
            kind = "example" if move.relative else "library"
            jobs.append(
                FileJob(source, target, _module_of(source), upstream, move.slice, kind)
            )
    helper_dir = L.HELPER_PACKAGE.replace(".", "/")
    helper_slices = sorted({s for s in L.HELPERS.values()}, key=L.SLICES.index)
    for slice_name in helper_slices:
        if slice_name == helper_slices[0]:
            jobs.append(
                FileJob(
                    "",
                    f"{helper_dir}/__init__.py",
                    "",
                    L.HELPER_PACKAGE,
                    slice_name,
                    "helper",
                )
            )
    for module, slice_name in L.HELPERS.items():
        leaf = module.rsplit(".", 1)[1]
        source = module.replace(".", "/") + ".py"
        jobs.append(
            FileJob(
                source,
                f"{helper_dir}/{leaf}.py",
                module,
                f"{L.HELPER_PACKAGE}.{leaf}",
                slice_name,
                "helper",
                drop=tuple(n for (p, n) in L.DROPPED_TESTS if p == source),
            )
        )
    for entry in L.TESTS:
        directory = root / entry.project_dir
        names = entry.files or tuple(
            sorted(
                p.name for p in directory.glob("*.py") if p.name not in entry.exclude
            )
        )
        for name in names:
            source = f"{entry.project_dir}/{name}"
            if not (root / source).is_file():
                raise ExportError(f"layout: {source} does not exist")
            target = f"{entry.upstream_dir}/{name}"
            drop = tuple(n for (p, n) in L.DROPPED_TESTS if p == source)
            jobs.append(
                FileJob(
                    source,
                    target,
                    _module_of(source),
                    _module_of(target),
                    entry.slice,
                    "test",
                    unit=entry.unit,
                    drop=drop,
                )
            )
    for conftest in L.CONFTESTS:
        jobs.append(
            FileJob(
                "tests/conftest.py",
                conftest.path,
                "tests.conftest",
                _module_of(conftest.path),
                conftest.slice,
                "test",
                keep=conftest.keep,
                annotations=conftest.annotations,
            )
        )
    return jobs


@dataclass(frozen=True)
class Resolved:
    """What a dotted project name becomes."""

    name: str | None  # dotted upstream name (module[.attr]) or builtin; None: see below
    slice: str | None = None  # slice of the module it lands in
    dropped: str = ""  # why, when the name is in a dropped module
    noop: str = ""  # SYMBOLS noop
    builtin: bool = False
    env: bool = False  # the project's envs module
    job: FileJob | None = None  # the file of the module part, when moved


class ModuleMap:
    def __init__(self, jobs: list[FileJob]):
        self.jobs = jobs
        self.by_module: dict[str, FileJob] = {}
        for job in jobs:
            if job.source and job.keep is None:
                self.by_module.setdefault(job.module, job)
        self.by_source = {j.source: j for j in jobs if j.source and j.keep is None}

    def resolve(self, dotted: str) -> Resolved | None:
        """None: not a project name at all."""
        if (
            dotted != PROJECT
            and not dotted.startswith(PROJECT + ".")
            and not (dotted.startswith("tests."))
        ):
            return None
        if dotted in L.SYMBOLS:
            sym = L.SYMBOLS[dotted]
            if sym.noop:
                return Resolved(None, noop=sym.noop)
            if sym.module is None:
                return Resolved(sym.name, builtin=True)
            return Resolved(f"{sym.module}.{sym.name}")
        if dotted == "vllm_disagg.envs":
            return Resolved("vllm.envs", env=True)
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            prefix = ".".join(parts[:end])
            rest = parts[end:]
            job = self.by_module.get(prefix)
            if job is not None:
                return Resolved(".".join([job.upstream, *rest]), job.slice, job=job)
            if prefix in L.UPSTREAM_PACKAGES and rest:
                # `vllm_disagg.distributed.kv_transfer.register_connectors`
                # is a SYMBOLS entry; a moved submodule was matched above.
                continue
            if prefix in L.UPSTREAM_PACKAGES:
                return Resolved(L.UPSTREAM_PACKAGES[prefix])
        for end in range(len(parts), 0, -1):
            prefix = ".".join(parts[:end])
            if prefix in L.DROPPED:
                return Resolved(None, dropped=f"{prefix}: {L.DROPPED[prefix]}")
        if dotted.startswith("tests."):
            return None
        return Resolved(None, dropped=f"{dotted}: not in the export layout")


# --- text ------------------------------------------------------------------------


class TextRewriter:
    """Strings, docstrings and comments."""

    def __init__(self, modules: ModuleMap, env_names: dict[str, str]):
        self.modules = modules
        self.env_names = env_names

    def __call__(self, text: str, problems: list[str]) -> str:
        for old, new in L.TEXT:
            text = text.replace(old, new)
        text = _ENV.sub(lambda m: self._env(m.group(0), problems), text)
        text = _PATH.sub(lambda m: self._path(m.group(0), problems), text)
        text = _DOTTED.sub(lambda m: self._dotted(m.group(0), problems), text)
        return text

    def _env(self, name: str, problems: list[str]) -> str:
        if name in self.env_names:
            return self.env_names[name]
        problems.append(f"{name} has no in-tree name (layout.ENV_VARS)")
        return name

    def _path(self, path: str, problems: list[str]) -> str:
        job = self.modules.by_source.get(path) or self.modules.by_source.get(
            path.rstrip("/") + "/__init__.py"
        )
        if job is not None:
            return job.target if path.endswith(".py") else job.target.rsplit("/", 1)[0]
        if _module_of(path) == "vllm_disagg.testing":  # the helpers' directory
            return L.HELPER_PACKAGE.replace(".", "/")
        resolved = self.modules.resolve(_module_of(path))
        if resolved is not None and resolved.name and resolved.job is None:
            return resolved.name.replace(".", "/") + (
                ".py" if path.endswith(".py") else ""
            )
        problems.append(f"path {path} is not exported")
        return path

    def _dotted(self, dotted: str, problems: list[str]) -> str:
        resolved = self.modules.resolve(dotted)
        if resolved is None or resolved.name is None:
            why = resolved.dropped or resolved.noop if resolved else "unmapped"
            problems.append(f"{dotted} ({why})")
            return dotted
        return resolved.name


# --- code ------------------------------------------------------------------------


def _dotted_expr(name: str) -> cst.Attribute | cst.Name:
    return cst.parse_expression(name)  # type: ignore[return-value]


def _relative(
    from_module: str, from_is_package: bool, target: str
) -> tuple[int, str] | None:
    """(dots, module) of a relative import of ``target`` from ``from_module``."""
    package = from_module if from_is_package else from_module.rsplit(".", 1)[0]
    pkg_parts, tgt_parts = package.split("."), target.split(".")
    common = 0
    while (
        common < min(len(pkg_parts), len(tgt_parts))
        and pkg_parts[common] == tgt_parts[common]
    ):
        common += 1
    if common == 0:
        return None
    return len(pkg_parts) - common + 1, ".".join(tgt_parts[common:])


@dataclass
class Bindings:
    """Local names the file's project imports bind."""

    env: set[str] = field(default_factory=set)  # aliases of vllm_disagg.envs
    builtins: dict[str, str] = field(default_factory=dict)  # local -> builtin
    noop: dict[str, str] = field(default_factory=dict)  # local -> why


class Rewriter(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(
        self, job: FileJob, modules: ModuleMap, text: TextRewriter, slice_name: str
    ):
        super().__init__()
        self.job = job
        self.modules = modules
        self.text = text
        self.slice = slice_name
        self.bindings = Bindings()
        self.problems: list[str] = []
        self.env_by_project = {v.project: v for v in L.ENV_VARS}
        self.env_by_accessor = {v.accessor: v for v in L.ENV_VARS if v.accessor}
        self.env_used: set[str] = set()
        self._called: set[int] = set()
        self._attr_names: set[int] = set()
        self._line = 0
        self._in_import = 0
        self._noop_uses: dict[int, tuple[cst.Name, str]] = {}

    # -- bookkeeping
    def _problem(self, node: cst.CSTNode, what: str) -> None:
        try:
            line = self.get_metadata(PositionProvider, node).start.line
        except KeyError:
            line = self._line
        self.problems.append(f"{self.job.source}:{line}: {what}")

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self._line = self.get_metadata(PositionProvider, node).start.line

    def _text(self, node: cst.CSTNode, value: str) -> str:
        found: list[str] = []
        out = self.text(value, found)
        for what in found:
            self._problem(node, what)
        return out

    def _check_slice(self, node: cst.CSTNode, resolved: Resolved, name: str) -> None:
        if resolved.slice and L.SLICES.index(resolved.slice) > L.SLICES.index(
            self.slice
        ):
            self._problem(node, f"{name} belongs to the later slice {resolved.slice!r}")

    # -- imports
    def _absolute(self, node: cst.ImportFrom) -> str:
        module = get_full_name_for_node(node.module) if node.module else ""
        if not node.relative:
            return module or ""
        base = self.job.module.split(".")
        if not self.job.source.endswith("__init__.py"):
            base = base[:-1]
        base = base[: len(base) - (len(node.relative) - 1)]
        return ".".join([*base, module] if module else base)

    def _relative_to(self, module: str) -> tuple[int, str] | None:
        job = self.job
        if job.kind == "example":
            top = job.upstream.split(".")[0]
            if module == top or module.startswith(top + "."):
                return _relative(job.upstream, _is_package(job), module)
        if job.kind == "test":
            package = job.upstream.rsplit(".", 1)[0]
            if module.rsplit(".", 1)[0] == package:
                return _relative(job.upstream, False, module)
        return None

    def _rewrite_from(self, node: cst.ImportFrom) -> list[cst.BaseSmallStatement]:
        module = self._absolute(node)
        if module in FORBIDDEN and not node.relative:
            self._problem(
                node, f"from {module} import ...: forbidden upstream, import the module"
            )
            return [node]
        project = module == PROJECT or module.startswith(PROJECT + ".")
        # An exported test module imported absolutely (tests.router.conftest).
        project |= module in self.modules.by_module and module.startswith("tests.")
        if not project and not node.relative:
            return [node]
        if (
            not project
            and self.modules.resolve(module) is None
            and module not in (self.modules.by_module)
        ):
            # relative import of something that is not exported
            self._problem(node, f"relative import of {module}, which is not exported")
            return [node]
        if isinstance(node.names, cst.ImportStar):
            self._problem(node, f"star import from {module}")
            return [node]
        extra: list[cst.BaseSmallStatement] = []
        groups: dict[str, list[cst.ImportAlias]] = {}
        for alias in node.names:
            name = get_full_name_for_node(alias.name) or ""
            local = alias.asname.name.value if alias.asname else name  # type: ignore[union-attr]
            full = f"{module}.{name}" if module else name
            resolved = self.modules.resolve(full)
            if resolved is None:
                self._problem(node, f"from {module} import {name}: unmapped")
                continue
            if resolved.env:
                self.bindings.env.add(local)
                env = cst.ImportAlias(
                    name=_dotted_expr("vllm.envs"),
                    asname=cst.AsName(name=cst.Name(local)),
                )
                extra.append(cst.Import(names=[env]))
                continue
            if resolved.noop:
                self.bindings.noop[local] = resolved.noop
                continue
            if resolved.builtin:
                self.bindings.builtins[local] = resolved.name or ""
                continue
            if resolved.name is None:
                self._problem(node, f"from {module} import {name}: {resolved.dropped}")
                continue
            self._check_slice(node, resolved, full)
            target_module, target_name = resolved.name.rsplit(".", 1)
            asname = (
                alias.asname
                if alias.asname
                else (
                    cst.AsName(name=cst.Name(local)) if local != target_name else None
                )
            )
            groups.setdefault(target_module, []).append(
                alias.with_changes(name=cst.Name(target_name), asname=asname)
            )
        out: list[cst.BaseSmallStatement] = []
        whole = len(groups) == 1 and len(next(iter(groups.values()))) == len(node.names)
        for target_module, aliases in groups.items():
            rel = self._relative_to(target_module)
            if rel is not None:
                dots, mod = rel
                where = {
                    "module": _dotted_expr(mod) if mod else None,
                    "relative": [cst.Dot()] * dots,
                }
            else:
                where = {"module": _dotted_expr(target_module), "relative": []}
            if whole:
                # one module: keep the statement's layout (parentheses, comments)
                out.append(node.with_changes(names=aliases, **where))
                continue
            aliases = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in aliases]
            several = len(aliases) > 1
            out.append(
                cst.ImportFrom(
                    names=aliases,
                    lpar=cst.LeftParen() if several else None,
                    rpar=cst.RightParen() if several else None,
                    **where,
                )
            )
        if not out and not extra:
            return []
        return [*extra, *out]

    def _rewrite_import(self, node: cst.Import) -> list[cst.BaseSmallStatement]:
        out: list[cst.BaseSmallStatement] = []
        changed = False
        for alias in node.names:
            name = get_full_name_for_node(alias.name) or ""
            bare = alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)
            if name in FORBIDDEN and (alias.asname is None):
                module, asname = FORBIDDEN[name]
                out.append(
                    cst.Import(
                        names=[
                            cst.ImportAlias(
                                name=cst.Name(module),
                                asname=cst.AsName(name=cst.Name(asname)),
                            )
                        ]
                    )
                )
                changed = True
                continue
            if name == PROJECT or name.startswith(PROJECT + "."):
                changed = True
                resolved = self.modules.resolve(name)
                if resolved is None or resolved.name is None or resolved.builtin:
                    why = resolved.dropped if resolved else "unmapped"
                    self._problem(node, f"import {name}: {why}")
                    continue
                if resolved.env:
                    local = alias.asname.name.value if alias.asname else "envs"  # type: ignore[union-attr]
                    self.bindings.env.add(local)
                if alias.asname is None:
                    self._problem(
                        node, f"import {name} without `as`: its uses are not rewritten"
                    )
                    continue
                self._check_slice(node, resolved, name)
                out.append(
                    cst.Import(
                        names=[bare.with_changes(name=_dotted_expr(resolved.name))]
                    )
                )
                continue
            out.append(cst.Import(names=[bare]))
        return out if changed else [node]

    def leave_SimpleStatementLine(self, original, updated):
        body: list[cst.BaseSmallStatement] = []
        changed = False
        for before, stmt in zip(original.body, updated.body):
            if isinstance(stmt, cst.ImportFrom):
                new = self._rewrite_from(stmt)
            elif isinstance(stmt, cst.Import):
                new = self._rewrite_import(stmt)
            elif (
                isinstance(stmt, cst.Expr)
                and isinstance(stmt.value, cst.Call)
                and isinstance(stmt.value.func, cst.Name)
                and stmt.value.func.value in self.bindings.noop
                and not stmt.value.args
            ):
                self._noop_uses.pop(id(before.value.func), None)  # type: ignore[attr-defined]
                new = []
            else:
                new = [stmt]
            changed |= new != [stmt]
            body.extend(new)
        if not changed:
            return updated
        if not body:
            return cst.RemoveFromParent()
        first = updated.with_changes(
            body=[body[0].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]
        )
        rest = [
            cst.SimpleStatementLine(
                body=[s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]
            )
            for s in body[1:]
        ]
        return cst.FlattenSentinel([first, *rest]) if rest else first

    # -- names
    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._attr_names.add(id(node.attr))

    def visit_Call(self, node: cst.Call) -> None:
        self._called.add(id(node.func))

    def visit_Import(self, node: cst.Import) -> None:
        self._in_import += 1

    def leave_Import(self, original, updated):
        self._in_import -= 1
        return updated

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        self._in_import += 1

    def leave_ImportFrom(self, original, updated):
        self._in_import -= 1
        return updated

    def leave_Name(self, original, updated):
        if id(original) in self._attr_names or self._in_import:
            return updated
        if updated.value in self.bindings.builtins:
            return updated.with_changes(value=self.bindings.builtins[updated.value])
        if updated.value in self.bindings.noop:
            self._noop_uses[id(original)] = (original, updated.value)
        return updated

    def leave_Module(self, original, updated):
        for node, name in self._noop_uses.values():
            self._problem(
                node,
                f"{name} is used other than as a call statement: "
                f"{self.bindings.noop[name]}",
            )
        return updated

    def leave_Attribute(self, original, updated):
        if not (
            isinstance(original.value, cst.Name)
            and original.value.value in self.bindings.env
        ):
            return updated
        attr = original.attr.value
        if attr in self.env_by_project:
            var = self.env_by_project[attr]
            self.env_used.add(var.name)
            return cst.SimpleString(f'"{var.name}"')
        if attr in self.env_by_accessor and id(original) in self._called:
            return updated  # leave_Call rewrites the call
        self._problem(
            original, f"vllm_disagg.envs.{attr} has no in-tree form (layout.ENV_VARS)"
        )
        return updated

    def leave_Call(self, original, updated):
        func = original.func
        if (
            isinstance(func, cst.Attribute)
            and isinstance(func.value, cst.Name)
            and func.value.value in self.bindings.env
            and func.attr.value in self.env_by_accessor
        ):
            var = self.env_by_accessor[func.attr.value]
            if updated.args:
                self._problem(
                    original, f"envs.{func.attr.value}() called with arguments"
                )
                return updated
            self.env_used.add(var.name)
            return cst.Attribute(
                value=cst.Name(func.value.value), attr=cst.Name(var.name)
            )
        return updated

    def leave_FormattedString(self, original, updated):
        # f"set {envs.<PLUGIN NAME>} ..." -> f"set <TREE NAME> ..."
        parts: list[cst.BaseFormattedStringContent] = []
        for part in updated.parts:
            if (
                isinstance(part, cst.FormattedStringExpression)
                and isinstance(part.expression, cst.SimpleString)
                and part.conversion is None
                and part.format_spec is None
                and re.fullmatch(r"\"[A-Z0-9_]+\"", part.expression.value)
            ):
                part = cst.FormattedStringText(value=part.expression.value.strip('"'))
            if (
                parts
                and isinstance(part, cst.FormattedStringText)
                and isinstance(parts[-1], cst.FormattedStringText)
            ):
                parts[-1] = cst.FormattedStringText(value=parts[-1].value + part.value)
            else:
                parts.append(part)
        return updated.with_changes(parts=parts)

    # -- text
    def leave_SimpleString(self, original, updated):
        return updated.with_changes(value=self._text(original, updated.value))

    def leave_FormattedStringText(self, original, updated):
        return updated.with_changes(value=self._text(original, updated.value))

    def leave_Comment(self, original, updated):
        return updated.with_changes(value=self._text(original, updated.value))


# --- module-level edits ------------------------------------------------------------


def _top_names(stmt: cst.CSTNode) -> set[str]:
    if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
        return {stmt.name.value}
    if isinstance(stmt, cst.SimpleStatementLine):
        names = set()
        for small in stmt.body:
            targets = []
            if isinstance(small, cst.Assign):
                targets = [t.target for t in small.targets]
            elif isinstance(small, cst.AnnAssign):
                targets = [small.target]
            names |= {t.value for t in targets if isinstance(t, cst.Name)}
        return names
    return set()


def _is_import(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body
    )


def select(module: cst.Module, job: FileJob) -> tuple[cst.Module, list[str]]:
    """Drop the job's dropped top-level names, or keep only its kept ones
    (then also the imports nothing uses any more)."""
    problems: list[str] = []
    body = list(module.body)
    if job.drop:
        found = set()
        kept = []
        for stmt in body:
            names = _top_names(stmt)
            if names & set(job.drop):
                found |= names & set(job.drop)
                continue
            kept.append(stmt)
        for name in sorted(set(job.drop) - found):
            problems.append(
                f"{job.source}: layout drops {name}, which it does not define"
            )
        body = _prune_imports(kept)
    if job.keep is not None:
        wanted = set(job.keep)
        found = set()
        kept = []
        for stmt in body:
            names = _top_names(stmt)
            if names and not (names & wanted):
                continue
            found |= names & wanted
            kept.append(stmt)
        for name in sorted(wanted - found):
            problems.append(
                f"{job.source}: layout keeps {name}, which it does not define"
            )
        retype = dict(job.annotations)
        for i, stmt in enumerate(kept):
            small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
            if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                new = retype.pop(small.target.value, None)
                if new is not None:
                    annotation = small.annotation.with_changes(
                        annotation=cst.parse_expression(new)
                    )
                    kept[i] = stmt.with_changes(
                        body=[small.with_changes(annotation=annotation)]
                    )
        for name in sorted(retype):
            problems.append(
                f"{job.source}: layout retypes {name}, which it does not annotate"
            )
        body = _prune_imports(kept)
    return module.with_changes(body=body), problems


def _prune_imports(body: list[cst.CSTNode]) -> list[cst.CSTNode]:
    used: set[str] = set()

    class Names(cst.CSTVisitor):
        def visit_Name(self, node: cst.Name) -> None:
            used.add(node.value)

        def visit_SimpleString(self, node: cst.SimpleString) -> None:
            used.update(re.findall(r"[A-Za-z_]\w*", node.value))  # string annotations

    for stmt in body:
        if not _is_import(stmt):
            stmt.visit(Names())
    out = []
    for stmt in body:
        if not _is_import(stmt):
            out.append(stmt)
            continue
        small_out = []
        for small in stmt.body:
            if isinstance(small, cst.ImportFrom) and get_full_name_for_node(
                small.module
            ) == ("__future__"):
                small_out.append(small)
                continue
            names = small.names
            if isinstance(names, cst.ImportStar):
                small_out.append(small)
                continue
            keep = []
            for alias in names:
                local = (
                    alias.asname.name.value  # type: ignore[union-attr]
                    if alias.asname
                    else (get_full_name_for_node(alias.name) or "").split(".")[0]
                )
                if local in used:
                    keep.append(alias.with_changes(comma=cst.MaybeSentinel.DEFAULT))
            if keep:
                small_out.append(small.with_changes(names=keep))
        if small_out:
            out.append(stmt.with_changes(body=small_out))
    return out


def _mark_expr(name: str) -> cst.BaseExpression:
    return cst.parse_expression(f"pytest.mark.{name}")


def markers(module: cst.Module, job: FileJob) -> cst.Module:
    """``pytestmark``: project-only markers out, ``cpu_test`` in on unit tests."""
    if job.kind != "test" or job.keep is not None:
        return module
    body = list(module.body)
    index = None
    for i, stmt in enumerate(body):
        if "pytestmark" in _top_names(stmt):
            index = i
    marks: list[cst.BaseExpression] = []
    if index is not None:
        assign = body[index].body[0]  # type: ignore[attr-defined]
        value = assign.value
        elements = (
            [e.value for e in value.elements]
            if isinstance(value, cst.List | cst.Tuple)
            else [value]
        )
        for element in elements:
            code = cst.Module(body=[]).code_for_node(element)
            if code in {f"pytest.mark.{m}" for m in L.DROPPED_MARKERS}:
                continue
            marks.append(element)
    # Only test modules: a marker in __init__.py, conftest.py or a helper
    # module selects nothing.
    name = job.target.rsplit("/", 1)[-1]
    if job.unit and (name.startswith("test_") or name.endswith("_test.py")):
        marks.append(_mark_expr("cpu_test"))
    if not marks:
        if index is not None:
            del body[index]
        return module.with_changes(body=body)
    value = (
        marks[0]
        if len(marks) == 1
        else cst.List(elements=[cst.Element(value=m) for m in marks])
    )
    line = cst.SimpleStatementLine(
        body=[
            cst.Assign(
                targets=[cst.AssignTarget(target=cst.Name("pytestmark"))], value=value
            )
        ]
    )
    if index is not None:
        body[index] = line.with_changes(leading_lines=body[index].leading_lines)
    else:
        last_import = max((i for i, s in enumerate(body) if _is_import(s)), default=-1)
        body.insert(last_import + 1, line.with_changes(leading_lines=[cst.EmptyLine()]))
        if not _imports_pytest(body):
            body.insert(last_import + 1, cst.parse_statement("import pytest\n"))
    return module.with_changes(body=body)


class _AsyncioMarks(cst.CSTTransformer):
    def __init__(self, module_marked: bool):
        super().__init__()
        self.module_marked = module_marked
        self.fixtures = 0

    def leave_FunctionDef(self, original, updated):
        if updated.asynchronous is None:
            return updated
        empty = cst.Module(body=[])
        decorators = list(updated.decorators)
        codes = [empty.code_for_node(d.decorator) for d in decorators]
        for i, code in enumerate(codes):
            if code == "pytest.fixture" or code.startswith("pytest.fixture("):
                new = _dotted_expr("pytest_asyncio.fixture")
                dec = decorators[i].decorator
                if isinstance(dec, cst.Call):
                    new = dec.with_changes(func=new)
                decorators[i] = decorators[i].with_changes(decorator=new)
                self.fixtures += 1
                return updated.with_changes(decorators=decorators)
        if (
            updated.name.value.startswith("test")
            and not self.module_marked
            and not any(c.startswith("pytest.mark.asyncio") for c in codes)
        ):
            decorators.append(cst.Decorator(decorator=_mark_expr("asyncio")))
            return updated.with_changes(decorators=decorators)
        return updated


def asyncio_marks(module: cst.Module, job: FileJob) -> cst.Module:
    """Upstream runs pytest-asyncio in strict mode (the project: auto): async
    tests get ``@pytest.mark.asyncio`` (unless the module's ``pytestmark`` has
    it), async fixtures ``@pytest_asyncio.fixture``."""
    if job.kind != "test":
        return module
    marked = any(
        "pytestmark" in _top_names(stmt)
        and "pytest.mark.asyncio" in cst.Module(body=[stmt]).code
        for stmt in module.body
    )
    transformer = _AsyncioMarks(marked)
    module = module.visit(transformer)
    if not transformer.fixtures:
        return module
    # In the first block of imports (the one pytest is in, if any): a later
    # block may follow code (a sys.path entry), where a new import is E402.
    body = list(module.body)
    imports = [i for i, s in enumerate(body) if _is_import(s)]
    after = next(
        (i for i in imports if "pytest" in cst.Module(body=[body[i]]).code.split()),
        imports[-1] if imports else -1,
    )
    body.insert(after + 1, cst.parse_statement("import pytest_asyncio\n"))
    return module.with_changes(body=body)


def _imports_pytest(body: list[cst.CSTNode]) -> bool:
    for stmt in body:
        if _is_import(stmt):
            for small in stmt.body:  # type: ignore[attr-defined]
                if isinstance(small, cst.Import) and any(
                    get_full_name_for_node(a.name) == "pytest" for a in small.names
                ):
                    return True
    return False


def _dedupe_env_import(code: str, aliases: set[str]) -> str:
    """One ``import vllm.envs as <alias>`` each, none where nothing reads it
    (the plugin's name constants became string literals)."""
    seen: set[str] = set()
    out = []
    for line in code.splitlines(keepends=True):
        found = re.fullmatch(r"\s*import vllm\.envs as (\w+)\s*", line)
        if found:
            alias = found.group(1)
            if alias in seen or not re.search(rf"\b{alias}\.[A-Za-z_]", code):
                continue
            seen.add(alias)
        out.append(line)
    return "".join(out)


def add_spdx(code: str) -> str:
    if code.startswith(SPDX):
        return code
    if code.startswith("#!"):
        first, _, rest = code.partition("\n")
        return f"{first}\n{SPDX}{rest}"
    return SPDX + code


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
    code = _dedupe_env_import(new.code, rewriter.bindings.env)
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


# --- vllm/envs.py ------------------------------------------------------------------


def _top_level(module: cst.Module, what: str, match) -> cst.CSTNode:
    found = [stmt for stmt in module.body if match(stmt)]
    if len(found) != 1:
        raise ExportError(
            f"vllm/envs.py: {what} found {len(found)} times, expected once"
        )
    return found[0]


def _assigns(stmt: cst.CSTNode, name: str) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    if isinstance(small, cst.AnnAssign):
        return isinstance(small.target, cst.Name) and small.target.value == name
    if isinstance(small, cst.Assign):
        return any(
            isinstance(t.target, cst.Name) and t.target.value == name
            for t in small.targets
        )
    return False


def add_env_vars(source: str, env_vars: tuple[L.EnvVar, ...]) -> str:
    """vllm/envs.py with ``env_vars`` declared: each in the ``if
    TYPE_CHECKING:`` block and in the ``environment_variables`` dict (with its
    comment), and their helper functions before the dict. Both anchors must
    match exactly once, and no variable may exist already; else ExportError."""
    if not env_vars:
        return source
    wrapper = MetadataWrapper(cst.parse_module(source))
    module = wrapper.module
    positions = wrapper.resolve(PositionProvider)
    checking = _top_level(
        module,
        "`if TYPE_CHECKING:`",
        lambda s: isinstance(s, cst.If)
        and isinstance(s.test, cst.Name)
        and s.test.value == "TYPE_CHECKING",
    )
    table = _top_level(
        module,
        "the `environment_variables` assignment",
        lambda s: _assigns(s, "environment_variables"),
    )
    value = table.body[0].value  # type: ignore[attr-defined]
    if not isinstance(value, cst.Dict):
        raise ExportError("vllm/envs.py: environment_variables is not a dict display")
    existing = {
        e.key.evaluated_value
        for e in value.elements
        if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString)
    }
    for var in env_vars:
        if var.name in existing or re.search(rf"^\s+{var.name}\s*:", source, re.M):
            raise ExportError(f"vllm/envs.py already declares {var.name}")
    lines = source.splitlines(keepends=True)
    # Insert bottom-up so earlier positions stay valid.
    dict_end = positions[value].end.line  # the line of the closing brace
    entries = []
    for var in env_vars:
        entries += [
            f"    # {line}\n" if line else "    #\n"
            for line in var.comment.splitlines()
        ]
        entries.append(f'    "{var.name}": {var.parser},\n')
    lines[dict_end - 1 : dict_end - 1] = entries
    helpers = [var.helper for var in env_vars if var.helper]
    if helpers:
        start = positions[table].start.line
        lines[start - 1 : start - 1] = [h.rstrip("\n") + "\n\n\n" for h in helpers]
    block_end = positions[checking].end.line
    lines[block_end:block_end] = [
        f"    {v.name}: {v.type} = {v.default}\n" for v in env_vars
    ]
    out = "".join(lines)
    cst.parse_module(out)  # still Python
    return out
