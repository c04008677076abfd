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


# --- inserting project-written statements ----------------------------------------


def insert_after(
    module: cst.Module,
    scope: str,
    matcher: m.BaseMatcherNode,
    new: Sequence[cst.BaseStatement],
    what: str,
    where: str,
    before: bool = False,
) -> cst.Module:
    """Put statements right after (or ``before``) the one statement of
    ``scope`` that ``matcher`` matches."""

    def place(node: cst.CSTNode):
        assert isinstance(node, cst.BaseStatement)
        return cst.FlattenSentinel([*new, node] if before else [node, *new])

    return replace_once(module, scope, matcher, place, what, where)


def insert_field(
    module: cst.Module,
    class_name: str,
    after: str,
    new: Sequence[cst.BaseStatement],
    where: str,
) -> cst.Module:
    """Add attributes to a class after the attribute ``after`` *and its
    docstring* (config classes document each field by the string after it)."""
    cls = find_scope(module, class_name, where)
    assert isinstance(cls, cst.ClassDef)
    body = list(cls.body.body)
    present = set().union(*(_defined_names(s) for s in body))
    for stmt in new:
        for name in _defined_names(stmt) & present:
            raise ExportError(f"{where}: {class_name}.{name} is defined already")
    hits = [i for i, s in enumerate(body) if after in _defined_names(s)]
    if len(hits) != 1:
        raise ExportError(f"{where}: {class_name}.{after} is defined {len(hits)} times")
    index = hits[0] + 1
    if index < len(body) and m.matches(
        body[index],
        m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())]),
    ):
        index += 1
    body[index:index] = new
    return module.deep_replace(
        cls, cls.with_changes(body=cls.body.with_changes(body=body))
    )


def add_import_name(
    module: cst.Module, from_module: str, name: str, where: str
) -> cst.Module:
    """Add ``name`` to the one top-level ``from from_module import (...)``, in
    isort's order (case-insensitive, as upstream's ruff config sorts)."""
    matcher = m.ImportFrom(module=attribute_chain(from_module))

    def add(node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.ImportFrom) and not isinstance(
            node.names, cst.ImportStar
        )
        names = list(node.names)
        if any(a.evaluated_name == name for a in names):
            return node
        index = next(
            (i for i, a in enumerate(names) if a.evaluated_name.lower() > name.lower()),
            len(names),
        )
        if index == len(names):
            last = names[-1]
            names[-1] = last.with_changes(comma=names[0].comma)
            names.append(cst.ImportAlias(name=cst.Name(name), comma=last.comma))
        else:
            names.insert(
                index, cst.ImportAlias(name=cst.Name(name), comma=names[index].comma)
            )
            if index == len(names) - 2:  # before the last, whose comma may be absent
                names[index] = names[index].with_changes(comma=names[0].comma)
        return node.with_changes(names=names)

    return replace_once(
        module, "", matcher, add, f"from {from_module} import (...)", where
    )


def ensure_import_sorted(module: cst.Module, from_module: str, name: str, where: str):
    """Add ``from from_module import name`` among the module's top-level
    ``from vllm... import`` lines, before the first that sorts after it."""
    if defines(module, name):
        return module
    (stmt,) = statements(f"from {from_module} import {name}\n")
    body = list(module.body)
    top = from_module.split(".")[0]
    hits = []
    for i, s in enumerate(body):
        if m.matches(s, m.SimpleStatementLine(body=[m.ImportFrom()])):
            other = dotted(s.body[0].module)
            if other.split(".")[0] == top:
                hits.append((i, other))
    if not hits:
        raise ExportError(
            f"{where}: no top-level `from {top}... import` to place {name} among"
        )
    index = next((i for i, other in hits if other > from_module), hits[-1][0] + 1)
    body.insert(index, stmt)
    return module.with_changes(body=body)


def select_subclass(
    scope: str,
    class_name: str,
    condition: str,
    from_module: str,
    subclass: str,
    local: str,
) -> Callable[[cst.Module, str], cst.Module]:
    """At the one statement of ``scope`` that uses ``class_name`` (imports
    aside), choose the class in a local first::

        local: type[Cls] = Cls
        if <condition>:
            from <from_module> import <subclass>

            local = <subclass>
        <statement, with Cls replaced by local>

    The subclass module is imported where it is chosen: it imports the module
    being edited (no cycle), and only step-sync deployments load it."""

    def edit(module: cst.Module, where: str) -> cst.Module:
        scope_node = find_scope(module, scope, where)
        imports = m.findall(scope_node, m.ImportAlias(name=m.Name(class_name)))
        import_names = {id(a.name) for a in imports}
        uses = [
            n
            for n in m.findall(scope_node, m.Name(class_name))
            if id(n) not in import_names
        ]
        if len(uses) != 1:
            raise ExportError(
                f"{where}: {class_name} is used {len(uses)} times in {scope}, expected "
                "once"
            )
        (use,) = uses
        users = [
            s
            for s in m.findall(scope_node, m.SimpleStatementLine())
            if m.findall(s, m.MatchIfTrue(lambda n: n is use))
        ]
        if len(users) != 1:
            raise ExportError(
                f"{where}: no single statement uses {class_name} in {scope}"
            )
        (statement,) = users
        chooser = statements(
            f"{local}: type[{class_name}] = {class_name}\n"
            f"if {condition}:\n"
            f"    from {from_module} import {subclass}\n\n"
            f"    {local} = {subclass}\n"
        )
        chooser[0] = chooser[0].with_changes(leading_lines=statement.leading_lines)
        renamed = statement.deep_replace(use, cst.Name(local)).with_changes(
            leading_lines=[]
        )
        return module.deep_replace(statement, cst.FlattenSentinel([*chooser, renamed]))

    return edit
