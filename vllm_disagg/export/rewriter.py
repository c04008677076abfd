"""One project file's code and text rewritten to its upstream names.

:class:`TextRewriter` rewrites strings, docstrings and comments (literal
substitutions, ``VLLM_DISAGG_*`` names, module paths and dotted names);
:class:`Rewriter` rewrites the code: imports of project modules, names bound
by them, upstream's forbidden imports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import PositionProvider

from vllm_disagg.export import layout as L
from vllm_disagg.export.module_map import (
    PROJECT,
    FileJob,
    ModuleMap,
    Resolved,
    is_package,
    module_of,
)

_DOTTED = re.compile(r"(?<![\w.])vllm_disagg(?:\.[A-Za-z_]\w*)*")
_PATH = re.compile(r"(?<![\w/])vllm_disagg(?:/[A-Za-z_]\w*)+(?:\.py)?")
_ENV = re.compile(r"\bVLLM_DISAGG_[A-Z0-9_]+\b")
# Upstream's forbidden imports (tools/pre_commit/check_forbidden_imports.py)
# that have a drop-in replacement: module -> (module, asname).
FORBIDDEN = {"re": ("regex", "re"), "base64": ("pybase64", "base64")}

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
        if module_of(path) == "vllm_disagg.testing":  # the helpers' directory
            return L.HELPER_PACKAGE.replace(".", "/")
        resolved = self.modules.resolve(module_of(path))
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


def dotted_expr(name: str) -> cst.Attribute | cst.Name:
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
                return _relative(job.upstream, is_package(job), module)
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
                    name=dotted_expr("vllm.envs"),
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
                    "module": dotted_expr(mod) if mod else None,
                    "relative": [cst.Dot()] * dots,
                }
            else:
                where = {"module": dotted_expr(target_module), "relative": []}
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
                        names=[bare.with_changes(name=dotted_expr(resolved.name))]
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
