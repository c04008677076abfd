"""Module-level edits of a relocated file: kept and dropped top-level names,
unused imports pruned, test markers, the SPDX header."""

from __future__ import annotations

import re

import libcst as cst
from libcst.helpers import get_full_name_for_node

from vllm_disagg.export import layout as L
from vllm_disagg.export.module_map import FileJob
from vllm_disagg.export.rewriter import dotted_expr

SPDX = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)


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
                new = dotted_expr("pytest_asyncio.fixture")
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


def dedupe_env_import(code: str, aliases: set[str]) -> str:
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
