"""Upstream's own offline pre-commit hooks, run on what each commit changes.

The hooks are the tree's scripts under ``tools/pre_commit/`` (so a release
that changes a hook is checked by its own version), run the way
``.pre-commit-config.yaml`` runs them: with the changed files as arguments.
Hooks that need the network or other toolchains (mypy's pinned environment,
typos, markdownlint, shellcheck, the Rust hooks) are not run; the pull
request descriptions say so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# (hook script, which changed files it takes)
HOOKS: tuple[tuple[str, str], ...] = (
    ("check_spdx_header.py", "python"),
    ("check_init_lazy_imports.py", "python"),
    ("check_forbidden_imports.py", "python"),
    ("check_torch_cuda.py", "python"),
    ("validate_config.py", "python"),
    ("check_test_tethering.py", "tethering"),
)
NOT_RUN = (
    "mypy (needs its pinned environment), typos, markdownlint, shellcheck, "
    "actionlint, clang-format and the Rust hooks (not installed here; no file "
    "of those kinds changes except where said)"
)


def _wanted(kind: str, changed: list[str]) -> list[str]:
    if kind == "python":
        return [p for p in changed if p.endswith(".py")]
    return [
        p
        for p in changed
        if (p.startswith("tests/") and p.endswith(".py")) or p.startswith(".buildkite/")
    ]


def run_hooks(tree: Path, changed: list[str]) -> list[str]:
    """Run each hook on the changed files it takes; one line per failure."""
    failures = []
    for script, kind in HOOKS:
        files = _wanted(kind, changed)
        path = tree / "tools" / "pre_commit" / script
        if not files or not path.is_file():
            continue
        done = subprocess.run(
            [sys.executable, str(path), *files],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            output = (done.stdout + done.stderr).strip().splitlines()
            first = next((line for line in output if line.strip()), "(no output)")
            failures.append(f"{script}: {first}")
    return failures
