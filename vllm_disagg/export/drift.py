"""The drift report (``--check``): what another vLLM release does to the patch set.

Three questions, each answered from the other release's source:

* **Edits**: does each edit of the series still find its anchors there
  (exactly once), or where does it refuse?
* **Symbols**: has the code of each upstream symbol the registry names
  changed (its definition compared with the pin's), moved or gone?
* **Meaning**: the assumptions of the patch set that are not one symbol's
  code, each a probe of the other release (:data:`ASSUMPTIONS`): for example
  that the DP clients wake the other engines with ``FIRST_REQ``, which step
  sync's clients build on and which 0.33.0 removed.

The pinned side is read from the pinned source when one is given, else
from the installed wheel's files, which are verified against the pin.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from vllm_disagg.export import cst as anchors
from vllm_disagg.export.pin import module_file, parse_upstream, sha256_bytes
from vllm_disagg.export.source import ExportError, Pin, Source


@dataclass(frozen=True)
class Assumption:
    """Something the patch set relies on in an upstream file."""

    what: str  # the assumption, in words
    path: str
    holds: Callable[[cst.Module], bool]


def _mentions(token: str) -> Callable[[cst.Module], bool]:
    """The code uses ``token`` as a name or as a string constant."""

    def holds(module: cst.Module) -> bool:
        return token in _tokens(module)

    return holds


def _tokens(module: cst.Module) -> set[str]:
    class Collect(cst.CSTVisitor):
        def __init__(self):
            self.found: set[str] = set()

        def visit_Name(self, node: cst.Name) -> None:
            self.found.add(node.value)

        def visit_SimpleString(self, node: cst.SimpleString) -> None:
            value = node.evaluated_value
            self.found.add(value if isinstance(value, str) else "")

    visitor = Collect()
    module.visit(visitor)
    return visitor.found


def _static_method(scope: str) -> Callable[[cst.Module], bool]:
    def holds(module: cst.Module) -> bool:
        try:
            node = anchors.find_scope(module, scope, scope)
        except ExportError:
            return False
        return any(
            anchors.dotted(d.decorator) == "staticmethod" for d in node.decorators
        )

    return holds


ASSUMPTIONS: tuple[Assumption, ...] = (
    Assumption(
        "the DP clients wake the other engines with a FIRST_REQ message "
        "(step sync's clients replace that path: no wave wake-up on the wire)",
        "vllm/v1/engine/core_client.py",
        _mentions("FIRST_REQ"),
    ),
    Assumption(
        "ParallelConfig.sync_dp_state is a static method (the "
        "dp-collective-probe wraps it as one)",
        "vllm/config/parallel.py",
        _static_method("ParallelConfig.sync_dp_state"),
    ),
    Assumption(
        "DPEngineCoreProc runs DP waves (START_DP_WAVE), which step sync replaces",
        "vllm/v1/engine/core.py",
        _mentions("START_DP_WAVE"),
    ),
    Assumption(
        "CpuCommunicator does not implement all_gatherv (cpu-collectives-v adds it)",
        "vllm/distributed/device_communicators/cpu_communicator.py",
        lambda module: not _defines_method(module, "CpuCommunicator", "all_gatherv"),
    ),
    Assumption(
        "CpuPlatform declares no ray_device_key (cpu-ray-dp adds it)",
        "vllm/platforms/cpu.py",
        lambda module: not _defines_attr(module, "CpuPlatform", "ray_device_key"),
    ),
)


def _defines_method(module: cst.Module, cls: str, name: str) -> bool:
    try:
        anchors.find_scope(module, f"{cls}.{name}", cls)
        return True
    except ExportError:
        return False


def _defines_attr(module: cst.Module, cls: str, name: str) -> bool:
    try:
        node = anchors.find_scope(module, cls, cls)
    except ExportError:
        return False
    return any(name in anchors._defined_names(stmt) for stmt in node.body.body)


def _module(data: bytes | None, where: str) -> cst.Module | None:
    if data is None:
        return None
    return anchors.parse(data.decode("utf-8"), where)


def _symbol_code(module: cst.Module | None, scope: str) -> str | None:
    if module is None:
        return None
    try:
        return anchors.dotted(anchors.find_scope(module, scope, scope))
    except ExportError:
        return None


def pinned_files_from_wheel(pin: Pin) -> dict[str, bytes]:
    """The pinned files from the installed wheel, each checked against the pin."""
    from vllm_disagg.export.overlay import installed_vllm

    wheel = installed_vllm()
    files = {}
    for rel, digest in pin.files.items():
        path = wheel / rel.removeprefix("vllm/")
        data = path.read_bytes() if path.is_file() else b""
        if sha256_bytes(data) != digest:
            raise ExportError(
                f"{path} is not the pinned {rel}: give the pinned source "
                "with --sdist or --vllm-src"
            )
        files[rel] = data
    return files


def report(other: Source, pinned: dict[str, bytes], pin: Pin) -> list[str]:
    """The drift report's lines for ``other`` against the pinned files."""
    from vllm_disagg.export.edits import EDITS
    from vllm_disagg.patches import PATCHES

    lines = [f"edits ({len(EDITS)}), applied to {other.describe()}:"]
    applies = 0
    for edit in EDITS:
        where = f"{edit.path} ({edit.patch})"
        data = other.files.get(edit.path)
        if data is None:
            lines.append(f"  refuses  {edit.patch}: {edit.path} is missing")
            continue
        try:
            edit.apply(_module(data, where), where)
        except ExportError as exc:
            lines.append(f"  refuses  {edit.patch}: {exc}")
            continue
        applies += 1
        lines.append(f"  applies  {edit.patch}: {edit.what}")
    lines.append(f"edits: {applies} of {len(EDITS)} apply")

    lines.append("upstream symbols the registry names:")
    counts = {"same": 0, "changed": 0, "gone": 0, "n/a": 0}
    for patch in PATCHES:
        if patch.in_tree.form not in ("edit", "hand"):
            continue
        for dotted in parse_upstream(patch.upstream).qualified:
            rel = module_file(dotted, lambda r: r in pinned)
            if rel is None:
                continue
            scope = dotted.removeprefix(rel.removesuffix(".py").replace("/", ".") + ".")
            old = _symbol_code(_module(pinned[rel], rel), scope)
            new = _symbol_code(_module(other.files.get(rel), rel), scope)
            if old is None:
                # Added by the patch set, inherited, or imported into rel.
                status, detail = "n/a", f"not defined in the pinned {rel} either"
            elif new is None:
                status, detail = "gone", f"not defined in {rel}"
            elif new == old:
                status, detail = "same", ""
            else:
                diff = list(
                    difflib.unified_diff(old.splitlines(), new.splitlines(), n=0)
                )
                added = sum(
                    1 for d in diff if d.startswith("+") and not d.startswith("+++")
                )
                removed = sum(
                    1 for d in diff if d.startswith("-") and not d.startswith("---")
                )
                status, detail = "changed", f"+{added} -{removed} lines"
            counts[status] += 1
            lines.append(f"  {status:<8} {dotted} ({patch.name}) {detail}".rstrip())
    lines.append(
        f"symbols: {counts['same']} same, {counts['changed']} changed, "
        f"{counts['gone']} gone, {counts['n/a']} not defined in the pinned "
        "module (added, inherited or imported)"
    )

    lines.append("assumptions:")
    for assumption in ASSUMPTIONS:
        before = assumption.holds(_module(pinned[assumption.path], assumption.path))
        module = _module(other.files.get(assumption.path), assumption.path)
        after = module is not None and assumption.holds(module)
        if not before:
            raise ExportError(f"assumption does not hold on the pin: {assumption.what}")
        lines.append(f"  {'holds' if after else 'BROKEN':<8} {assumption.what}")
    return lines


def check_report(other_path: Path, pinned_source: Source | None, pin: Pin) -> list[str]:
    from vllm_disagg.export.source import check, read_source

    lines = check(other_path, pin)
    other = read_source(other_path, pin.files)
    if pinned_source is not None:
        pinned = {rel: pinned_source.files[rel] or b"" for rel in pin.files}
    else:
        pinned = pinned_files_from_wheel(pin)
    return lines + report(other, pinned, pin)
