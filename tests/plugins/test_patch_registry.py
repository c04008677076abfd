"""The patch registry lists every patch module, and each one applies cleanly."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import pytest

import vllm_disagg
import vllm_disagg.patches as patches_pkg
from vllm_disagg.errors import UnsupportedVllmVersionError
from vllm_disagg.patches import PATCHES


def _patch_modules_on_disk() -> set[str]:
    found = set()
    for info in pkgutil.walk_packages(patches_pkg.__path__, prefix="vllm_disagg.patches."):
        if info.ispkg or info.name.endswith("__main__"):
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
    env = {**os.environ, "VLLM_DISAGG_PROBE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert f"OK {len(PATCHES)}" in out.stdout


def test_registry_table_prints():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_disagg.patches"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for patch in PATCHES:
        assert patch.name in out.stdout


def test_version_check():
    vllm_disagg.check_vllm_version("0.32.0")
    vllm_disagg.check_vllm_version("0.32.0+cpu")
    with pytest.raises(UnsupportedVllmVersionError, match=r"supports vLLM 0\.32\.0 only.*0\.31\.2"):
        vllm_disagg.check_vllm_version("0.31.2")
