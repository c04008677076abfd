"""Structural anchors for edits of upstream files, with libcst.

An edit never quotes upstream source text. It names a qualified scope
(``"MoERunner._select_forward"``, ``"CpuPlatform"``, ``""`` for the module)
and, inside it, a libcst matcher for the node it changes. Each scope step and
each matcher must match exactly once, or the edit raises :class:`ExportError`
naming the file, the scope and what was found: a release that moved the code
refuses instead of being edited in the wrong place. The file's sha256 is
checked against the pin before any edit runs (:mod:`vllm_disagg.export.source`),
so within the pinned release these anchors are exact; on another release
(``--check``) the same anchors tell which edits still apply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import libcst as cst
import libcst.matchers as m

from vllm_disagg.export.source import ExportError

Replacement = Callable[[cst.CSTNode], cst.CSTNode | cst.RemovalSentinel]


def parse(text: str, where: str) -> cst.Module:
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise ExportError(f"{where}: not parseable Python ({exc.message})") from None


def statements(source: str) -> list[cst.BaseStatement]:
    """Project-written statements, parsed (for insertion)."""
    return list(cst.parse_module(source).body)


def _named(node: cst.CSTNode, name: str) -> bool:
    return isinstance(node, (cst.ClassDef, cst.FunctionDef)) and node.name.value == name


def find_scope(module: cst.Module, scope: str, where: str) -> cst.CSTNode:
    """The class or function at ``scope`` (dotted, from the module's top level).

    Only direct children are searched at each step (a method is a statement of
    its class body), so ``A.f`` never finds a nested ``A.g.f``."""
    node: cst.CSTNode = module
    walked: list[str] = []
    for name in filter(None, scope.split(".")):
        body = node.body if isinstance(node, cst.Module) else node.body.body
        found = [child for child in body if _named(child, name)]
        walked.append(name)
        if len(found) != 1:
            raise ExportError(
                f"{where}: {'.'.join(walked)} is defined {len(found)} times, "
                "expected once"
            )
        node = found[0]
    return node


def replace_once(
    module: cst.Module,
    scope: str,
    matcher: m.BaseMatcherNode,
    replacement: Replacement,
    what: str,
    where: str,
) -> cst.Module:
    """Replace the one node inside ``scope`` that ``matcher`` matches."""
    scope_node = find_scope(module, scope, where)
    found = m.findall(scope_node, matcher)
    if len(found) != 1:
        raise ExportError(
            f"{where}: {what} matches {len(found)} times in "
            f"{scope or 'the module'}, expected once"
        )
    return module.deep_replace(found[0], replacement(found[0]))


def class_body_insert(
    module: cst.Module,
    class_name: str,
    new: Sequence[cst.BaseStatement],
    where: str,
    after: str | None = None,
) -> cst.Module:
    """Add statements to a class body: after the attribute or method ``after``
    (which must be there exactly once), else at its end."""
    cls = find_scope(module, class_name, where)
    assert isinstance(cls, cst.ClassDef)
    body = list(cls.body.body)
    present = set().union(*(_defined_names(child) for child in body))
    for stmt in new:
        if clash := sorted(_defined_names(stmt) & present):
            raise ExportError(f"{where}: {class_name} already defines {clash[0]}")
    if after is None:
        index = len(body)
    else:
        hits = [i for i, child in enumerate(body) if after in _defined_names(child)]
        if len(hits) != 1:
            raise ExportError(
                f"{where}: {class_name}.{after} is defined {len(hits)} times, "
                "expected once"
            )
        index = hits[0] + 1
    body[index:index] = new
    return module.deep_replace(
        cls, cls.with_changes(body=cls.body.with_changes(body=body))
    )


def _defined_names(stmt: cst.CSTNode) -> set[str]:
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return {stmt.name.value}
    names: set[str] = set()
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                names.add(small.target.value)
            elif isinstance(small, cst.Assign):
                for target in small.targets:
                    if isinstance(target.target, cst.Name):
                        names.add(target.target.value)
    return names


def defines(module: cst.Module, name: str) -> bool:
    """Whether the module's top level binds ``name`` (a def, class,
    assignment or import)."""
    for stmt in module.body:
        if name in _defined_names(stmt):
            return True
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(
                    small, (cst.Import, cst.ImportFrom)
                ) and name in _import_names(small):
                    return True
    return False


def _import_names(node: cst.Import | cst.ImportFrom) -> set[str]:
    if isinstance(node.names, cst.ImportStar):
        return set()
    names = set()
    for alias in node.names:
        if alias.asname is not None:
            names.add(cst.ensure_type(alias.asname.name, cst.Name).value)
        else:
            names.add(cst.Module([]).code_for_node(alias.name).split(".")[0])
    return names


def _is_import_line(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in stmt.body
    )


def ensure_import(module: cst.Module, line: str, where: str) -> cst.Module:
    """Add a top-level import line (``from a import b``) unless every name it
    binds is bound already; it goes after the module's last top-level import
    (the formatter's isort rules then place it)."""
    (stmt,) = statements(line)
    assert _is_import_line(stmt), line
    wanted = set().union(*(_import_names(small) for small in stmt.body))
    if all(defines(module, name) for name in wanted):
        return module
    body = list(module.body)
    last = max((i for i, s in enumerate(body) if _is_import_line(s)), default=None)
    if last is None:
        raise ExportError(f"{where}: no top-level import to place {line!r} after")
    body.insert(last + 1, stmt)
    return module.with_changes(body=body)


def append(module: cst.Module, new: Sequence[cst.BaseStatement]) -> cst.Module:
    """Add statements at the end of the module."""
    return module.with_changes(body=[*module.body, *new])


def insert_after_top_level(
    module: cst.Module, name: str, new: Sequence[cst.BaseStatement], where: str
) -> cst.Module:
    """Add statements right after the top-level definition of ``name``."""
    body = list(module.body)
    hits = [i for i, stmt in enumerate(body) if name in _defined_names(stmt)]
    if len(hits) != 1:
        raise ExportError(
            f"{where}: {name} is defined {len(hits)} times, expected once"
        )
    body[hits[0] + 1 : hits[0] + 1] = new
    return module.with_changes(body=body)


def dotted(node: cst.CSTNode) -> str:
    """Source text of a name or attribute chain (``torch.ops.vllm``)."""
    return cst.Module([]).code_for_node(node)


def attribute_chain(text: str) -> m.BaseMatcherNode:
    """A matcher for a dotted name written in the project (``socket.AF_INET``)."""
    first, *rest = text.split(".")
    matcher: m.BaseMatcherNode = m.Name(first)
    for part in rest:
        matcher = m.Attribute(value=matcher, attr=m.Name(part))
    return matcher
