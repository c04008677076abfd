"""The pinned upstream source the export starts from, and how the pin is derived.

The export edits upstream files, so it must start from exactly the source its
edits were written against: the vLLM 0.32.0 sdist from PyPI (its sha256), its
version, and every upstream file that a registry entry with an in-tree form of
``edit`` or ``hand`` changes (each file's sha256). The files come from each
entry's ``upstream`` field (:func:`upstream_files`); a test checks that
:data:`PINNED_FILES` covers exactly those, so a new registry entry forces a pin
update.

The values were measured on the sdist downloaded from PyPI, and are measured
again by ``python -m vllm_disagg.export.pin SDIST``, which prints this module's
constants for a given sdist.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"
SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
# sha256 of vllm-0.32.0.tar.gz (44,549,956 bytes) as PyPI serves it.
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
# sha256 of each upstream file an `edit` or `hand` registry entry changes.
PINNED_FILES: dict[str, str] = {
    "vllm/config/kv_transfer.py": (
        "6c1aee67cd39507cd52df37725e88ced5baa63037c6912be011c8aa36ca55bfa"
    ),
    "vllm/config/parallel.py": (
        "e8dcfb67c1ace957dcc7e12569ee62eb0f983aec3901fdef27c13014cea4b760"
    ),
    "vllm/distributed/device_communicators/cpu_communicator.py": (
        "e75bfd60f00c5e24316884a3466b644b2722374ccfd8a6b75f086c1f9b2eb27f"
    ),
    "vllm/distributed/kv_transfer/kv_connector/factory.py": (
        "029202ea640823ac5cf9b0517bcc7d28daafde265ceb40eb4c8dd209093103b6"
    ),
    "vllm/engine/arg_utils.py": (
        "c10281277fd9a90dc8b22670db4f1af53708c5caa2aefee7aa861fa579329219"
    ),
    "vllm/entrypoints/cli/main.py": (
        "ba6fc0a28afea8059814b70077b3d1fddc80390305595b2957d67dd998680bf6"
    ),
    "vllm/entrypoints/serve/instrumentator/metrics.py": (
        "d511dd081071daeaf993a653e8716f73de9afbbece4c6eeacfe3a8c948a5bc74"
    ),
    "vllm/model_executor/layers/fused_moe/experts/cpu_moe.py": (
        "19128899c9878824b53dc0df7dc5f916cc7fab128742bc4285be6f96d1735d17"
    ),
    "vllm/model_executor/layers/fused_moe/runner/moe_runner.py": (
        "20b69fe514bebd6723a1378f89a564c8fec4144c30244101f629c3f32c188183"
    ),
    "vllm/platforms/cpu.py": (
        "e8c3220ce2a277de62f9329eb630940bfc8acdb8fb31d6dfddd1238140c264ee"
    ),
    "vllm/v1/attention/backends/cpu_attn.py": (
        "ffcb1e2b03ceb1d913e10457b1a30366bf630138b0e628616d635c55315d8f09"
    ),
    "vllm/v1/engine/core.py": (
        "458fd729771681b124d3a4d5b1c575f689bf789a5e0c8cc9f5c524eb6ec84f87"
    ),
    "vllm/v1/engine/core_client.py": (
        "386b528a69029507f80a2df4d6df2a4fa6ba2ba811501dc3449ceea58b5cd90a"
    ),
    "vllm/v1/engine/utils.py": (
        "8740c9af331597573d59941d3d65a58dbfd93c92f0144fd187b44bb25a6e4a2e"
    ),
    "vllm/v1/metrics/loggers.py": (
        "a17291f044251f1586457b6bd1542f98660724dd07a426d61ce852186b95b9e1"
    ),
    "vllm/v1/metrics/stats.py": (
        "f594c5ea0f9caebe54737528e0da0ffbbdc909d74cfd625e0e384afb324d9663"
    ),
    "vllm/v1/worker/cpu_model_runner.py": (
        "d2810a0bae39552342cb447d4e864763e76c5802422d830a9022d084263fc50c"
    ),
    "vllm/v1/worker/gpu_model_runner.py": (
        "4cf95efe4ea8caa3110dcd231ff95ceb97e8136f5056e6bdd388300a484c4a81"
    ),
}

IN_TREE_FORMS = ("edit", "hand")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Symbols:
    """The upstream symbols one registry entry names.

    ``qualified``: dotted names from ``vllm.`` on (``vllm.x.y.Class.method``).
    ``bare``: names without a module (``CoreEngineActorManager``), found in
    the package of the entry's first symbol."""

    qualified: tuple[str, ...]
    bare: tuple[str, ...]


_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def parse_upstream(upstream: str) -> Symbols:
    """Read an entry's ``upstream`` field.

    Its form: a dotted name from ``vllm.`` on, then `` / ``-separated names
    that are either dotted names from ``vllm.`` on or siblings of the name
    before (``Class.a / b`` is ``Class.a`` and ``Class.b``; ``mod.A / B`` is
    ``mod.A`` and ``mod.B``), then optional parenthesised names in the same
    form, where a name without ``vllm.`` is bare (``(CoreEngineActorManager)``,
    ``(GPUModelRunner's)``). Anything else raises ValueError, so a registry
    entry the pin cannot follow fails its test."""
    text = upstream.replace("'s)", ")")
    notes = re.findall(r"\(([^()]*)\)", text)
    main = re.sub(r"\([^()]*\)", " ", text).strip()
    qualified: list[str] = []
    bare: list[str] = []
    for part in _split(main, upstream):
        if part.startswith("vllm."):
            qualified.append(part)
        elif qualified:
            qualified.append(qualified[-1].rsplit(".", 1)[0] + "." + part)
        else:
            raise ValueError(f"upstream {upstream!r} does not start with a vllm.* name")
    for note in notes:
        for part in _split(note, upstream):
            (qualified if part.startswith("vllm.") else bare).append(part)
    return Symbols(tuple(qualified), tuple(bare))


def _split(text: str, upstream: str) -> list[str]:
    parts = [p.strip() for p in text.split(" / ")]
    for part in parts:
        if not _DOTTED.fullmatch(part):
            raise ValueError(f"upstream {upstream!r}: {part!r} is not a dotted name")
    return parts


def module_file(dotted: str, is_file: Callable[[str], bool]) -> str | None:
    """The file of the longest module prefix of ``dotted`` (``vllm.x.y.C.m``:
    ``vllm/x/y.py``, or ``vllm/x/y/__init__.py`` for a package), as a path
    relative to the source root; ``is_file`` says whether a relative path is a
    file of the tree. None when no prefix is a module."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = "/".join(parts[:end])
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if is_file(candidate):
                return candidate
    return None


def _defines(source: str, name: str) -> bool:
    """Whether a module's top level defines ``name`` (class or function)."""
    tree = ast.parse(source)
    return any(
        isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.name == name
        for node in tree.body
    )


def entry_files(upstream: str, root: Path) -> set[str]:
    """The files of a source tree at ``root`` that one entry's ``upstream``
    names. A bare name is looked up among the modules of the package of the
    entry's first symbol and must be defined at the top level of exactly one."""
    symbols = parse_upstream(upstream)

    def is_file(rel: str) -> bool:
        return (root / rel).is_file()

    files: set[str] = set()
    for dotted in symbols.qualified:
        rel = module_file(dotted, is_file)
        if rel is None:
            raise ValueError(f"{dotted}: no module of it in {root}")
        files.add(rel)
    if symbols.bare:
        first = module_file(symbols.qualified[0], is_file)
        package = (root / first).parent
        for name in symbols.bare:
            found = [
                path.relative_to(root).as_posix()
                for path in sorted(package.glob("*.py"))
                if _defines(path.read_text(encoding="utf-8"), name)
            ]
            if len(found) != 1:
                raise ValueError(
                    f"{name} (in {upstream!r}): defined in {len(found)} modules of "
                    f"{package.relative_to(root).as_posix()}, expected 1: {found}"
                )
            files.add(found[0])
    return files


def upstream_files(patches: Iterable, root: Path) -> dict[str, set[str]]:
    """Map each upstream file of a source tree that an ``edit`` or ``hand``
    entry of ``patches`` changes to the names of those entries."""
    files: dict[str, set[str]] = {}
    for patch in patches:
        if patch.in_tree.form not in IN_TREE_FORMS:
            continue
        for rel in entry_files(patch.upstream, root) | set(patch.also_changes):
            files.setdefault(rel, set()).add(patch.name)
    return files


def measure(sdist: Path, root: Path) -> str:
    """This module's constants for an sdist and its extracted tree ``root``
    (the directory holding PKG-INFO), as Python source."""
    from vllm_disagg.patches import PATCHES

    lines = [
        f'SDIST_SHA256 = "{sha256_file(sdist)}"',
        "PINNED_FILES: dict[str, str] = {",
    ]
    for rel in sorted(upstream_files(PATCHES, root)):
        digest = sha256_file(root / rel)
        entry = f'    "{rel}": "{digest}",'
        if len(entry) > 88:  # ruff format's shape of a value too long for a line
            entry = f'    "{rel}": (\n        "{digest}"\n    ),'
        lines.append(entry)
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tarfile
    import tempfile

    parser = argparse.ArgumentParser(
        prog="python -m vllm_disagg.export.pin",
        description="Print the pin constants measured on a vLLM sdist.",
    )
    parser.add_argument("sdist", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(args.sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".py")]
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp, members=members, **safe)
        (top,) = {m.name.split("/", 1)[0] for m in members}
        print(measure(args.sdist, Path(tmp) / top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
