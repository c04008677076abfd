"""The modules the export writes into vLLM's tree are real files: each one
imports only what the pinned vLLM has or what the export's edits add."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from vllm_disagg.export import step_sync

SOURCES = sorted(step_sync.UPSTREAM_SRC.rglob("*.py"))
# Names the step-sync commit's edits add to upstream modules.
ADDED = {("vllm.v1.metrics.stats", "StepSyncStats")}


def test_the_metrics_module_is_the_file_the_export_writes():
    assert step_sync.new_files() == {
        step_sync.METRICS_PATH: step_sync.METRICS_SOURCE.read_text()
    }
    assert step_sync.METRICS_SOURCE in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_import_resolves_against_the_pin_or_an_edit(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and (
                    (node.module, alias.name) not in ADDED
                ):
                    missing.append(f"{node.module}.{alias.name}")
    assert not missing, missing
