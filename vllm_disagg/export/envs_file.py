"""vllm/envs.py gains the exported slices' variables (:data:`.layout.ENV_VARS`)."""

from __future__ import annotations

import re

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from vllm_disagg.export import layout as L
from vllm_disagg.export.source import ExportError


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
