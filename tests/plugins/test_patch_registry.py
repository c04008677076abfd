"""The patch registry lists every patch module, and each one applies cleanly."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_disagg
import vllm_disagg.patches as patches_pkg
from vllm_disagg import envs
from vllm_disagg.errors import UnsupportedVllmVersionError
from vllm_disagg.patches import PATCHES, REGISTRY_MODULES
from vllm_disagg.patches.__main__ import (
    BEGIN,
    END,
    UPDATE_COMMAND,
    markdown_table,
    readme_table,
    update_readme,
)

README = Path(__file__).resolve().parents[2] / "README.md"


def _patch_modules_on_disk() -> set[str]:
    found = set()
    for info in pkgutil.walk_packages(
        patches_pkg.__path__, prefix="vllm_disagg.patches."
    ):
        if info.ispkg or info.name in REGISTRY_MODULES:
            continue
        found.add(info.name)
    return found


def test_every_patch_module_is_registered():
    assert _patch_modules_on_disk() == {p.module for p in PATCHES}


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_registry_entry_is_documented(patch):
    for field in ("upstream", "why", "how", "drop_when"):
        assert len(getattr(patch, field)) > 20, f"{patch.name}.{field} is too thin"
    assert patch.kind in ("enabler", "feature", "probe")
    # What it becomes in an in-tree fork (the export), and its upstream context.
    assert patch.in_tree.form in ("edit", "hand", "dropped"), patch.in_tree
    assert len(patch.in_tree.detail) > 20, f"{patch.name}.in_tree.detail is too thin"
    assert len(patch.related) >= 10, (
        f"{patch.name}.related: a PR, an issue, or why none"
    )
    if patch.kind == "probe":
        assert patch.in_tree.form == "dropped", (
            "a probe is measurement, never upstream code"
        )
    module = patch.load()
    assert module.__doc__ and "upstream" in module.__doc__.lower()


def test_apply_all_is_idempotent_and_verifiable():
    code = (
        "from vllm_disagg.patches import apply_all, verify_applied\n"
        "first = apply_all(); second = apply_all()\n"
        "assert first == second, (first, second)\n"
        "status = verify_applied()\n"
        "assert status and all(status.values()), status\n"
        "print('OK', len(first))\n"
    )
    env = {**os.environ, envs.VLLM_DISAGG_PROBE: "1"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert f"OK {len(PATCHES)}" in out.stdout


def test_registry_table_prints():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_disagg.patches"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for patch in PATCHES:
        assert patch.name in out.stdout


def test_readme_table_is_the_registry():
    """The README's table is generated: a registry change needs a regenerated README."""
    assert readme_table(README.read_text()) == markdown_table(), (
        f"README.md's patch table differs from vllm_disagg.patches.PATCHES; "
        f"regenerate it from the repository root with: {UPDATE_COMMAND}"
    )


def test_markdown_flag_prints_exactly_the_table():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_disagg.patches", "--markdown"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == markdown_table()
    rows = out.stdout.splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [
        p.name for p in PATCHES
    ]


def test_update_readme_rewrites_only_the_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{BEGIN}\n| stale | table |\n{END}\n\nafter\n")
    assert update_readme(readme) is True
    text = readme.read_text()
    assert text == f"# title\n\n{BEGIN}\n{markdown_table()}{END}\n\nafter\n"
    assert update_readme(readme) is False  # idempotent
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="no patch table markers"):
        update_readme(readme)


def test_version_check():
    vllm_disagg.check_vllm_version("0.32.0")
    vllm_disagg.check_vllm_version("0.32.0+cpu")
    with pytest.raises(
        UnsupportedVllmVersionError, match=r"supports vLLM 0\.32\.0 only.*0\.31\.2"
    ):
        vllm_disagg.check_vllm_version("0.31.2")
