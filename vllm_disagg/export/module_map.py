"""Where each exported project file goes, and what a dotted project name becomes.

:func:`plan` lists every exported file of every slice (:mod:`.layout`) as a
:class:`FileJob`; :class:`ModuleMap` resolves a project name (module or
module attribute) to its upstream name, or says why it is not exported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_disagg.export import layout as L
from vllm_disagg.export.source import ExportError

PROJECT = "vllm_disagg"


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


def module_of(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_package(job: FileJob) -> bool:
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
            sub = module_of(rel)
            upstream = move.upstream + (f".{sub}" if sub else "")
            kind = "example" if move.relative else "library"
            jobs.append(
                FileJob(source, target, module_of(source), upstream, move.slice, kind)
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
                    module_of(source),
                    module_of(target),
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
                module_of(conftest.path),
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
