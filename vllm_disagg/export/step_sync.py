"""The step-sync slice of the export: what the step-sync commit of the tree holds.

Four parts, each data or code the tree driver runs:

* :data:`EDITS` (:mod:`.step_sync_edits`): edits of upstream files
  (:class:`~vllm_disagg.export.edits.Edit`, anchored on qualified scopes, each
  matching once). ``ParallelConfig`` gets
  ``data_parallel_sync`` (``"wave"`` by default), the look-ahead and the peer
  timeout as fields; ``EngineArgs`` the matching fields and flags, and its
  ``create_engine_config`` prepares the group's secret; the four
  places 0.32 picks a DP class (``run_engine_core``, ``CoreEngineActorManager``,
  ``make_client``, ``make_async_mp_client``) pick the step-sync class for
  ``"step"``; ``launch_core_engines`` runs the DP coordinator without wave
  coordination for ``"step"``; ``SchedulerStats`` carries
  ``StepSyncStats`` to ``PrometheusStatLogger`` (the code these edits insert
  is real Python in :mod:`.step_sync_fragments`).
* :data:`MOVES` / :data:`DROPPED`: which project modules go where (module
  prefixes, matched on module boundaries) and which are not exported.
* :data:`REWRITES` (:mod:`.step_sync_rewrites`): step-sync-specific changes
  of the project's source, run on the project text *before* the generic
  relocation (they remove what refers to dropped modules, so what they write
  may already name upstream modules).
* :func:`new_files`: files the commit adds that are not a moved project
  module (the in-tree metrics module, written here).

:data:`TESTS` says which of the project's step-sync tests the commit carries
and what changes in them.
"""

from __future__ import annotations

from vllm_disagg.export import layout as L
from vllm_disagg.export.cst import insert_after, insert_field, select_subclass
from vllm_disagg.export.step_sync_edits import (
    ACTOR,
    CLIENTS,
    COORDINATOR_FIELD,
    CREDENTIALS,
    EDITS,
    ENGINE_CORE,
    FIELD,
    LOOKAHEAD_FIELD,
    METRICS,
    METRICS_PATH,
    METRICS_SOURCE,
    OPTION_FIELDS,
    SLICE,
    TIMEOUT_FIELD,
    UPSTREAM_SRC,
)
from vllm_disagg.export.step_sync_rewrites import (
    REWRITES,
    TEST_REWRITES,
    WORDS,
    sibling_imports,
)


def new_files() -> dict[str, str]:
    """Files of the commit that are no moved project module (upstream path ->
    text, without the SPDX header the driver adds)."""
    return {METRICS_PATH: METRICS_SOURCE.read_text()}


# --- module moves -----------------------------------------------------------------

# (project module prefix, upstream module prefix), matched on module
# boundaries (``vllm_disagg.v1.engine.core`` is not a prefix of
# ``vllm_disagg.v1.engine.core_client``): the slice's layout.MOVES. One
# package, so nothing collides with upstream's
# vllm/v1/engine/{core,core_client,coordinator}.py.
MOVES: tuple[tuple[str, str], ...] = tuple(
    (move.project, move.upstream) for move in L.MOVES if move.slice == SLICE
)
# Needed from other slices: vllm_disagg.wire (frames, logs) ->
# vllm.distributed.wire, moved by the p2p slice (layout.MOVES), which comes
# first in the series.
NEEDS: tuple[str, ...] = ("vllm_disagg.wire",)

# Project modules of step sync that are not exported (layout.DROPPED holds them).
DROPPED: dict[str, str] = {
    name: why
    for name, why in L.DROPPED.items()
    if name
    in (
        "vllm_disagg.v1.engine.coordinator",
        "vllm_disagg.v1.metrics.step_sync",
        "vllm_disagg.v1.metrics",
        "vllm_disagg.testing.step_sync",
    )
}


def moved(module: str) -> str | None:
    """The upstream name of a project module this slice moves, or None."""
    for project, upstream in sorted(MOVES, key=lambda p: -len(p[0])):
        if module == project or module.startswith(project + "."):
            return upstream + module[len(project) :]
    return None


def rewrite(module: str, path: str, text: str) -> str:
    """The step-sync rewrites of one project module or test (before
    relocation)."""
    if module.startswith("tests."):
        text = sibling_imports(path, text)
        for fn in TEST_REWRITES.get(module, ()):
            text = fn(path, text)
        return WORDS(path, text)
    if moved(module) is None:
        return text
    for fn in REWRITES.get(module, ()):
        text = fn(path, text)
    return WORDS(path, text)


# --- tests ------------------------------------------------------------------------

# (project path, upstream path, what changes). Unit tests of the protocol and
# of the engine classes go next to upstream's tests/v1/engine (the V1 Engine
# job runs that directory); the end-to-end tests next to
# tests/v1/distributed/test_*_dp.py.
TESTS: tuple[tuple[str, str, str], ...] = (
    (
        "tests/v1/engine/step_sync_helpers.py",
        "tests/v1/engine/step_sync/helpers.py",
        "none beyond imports",
    ),
    (
        "tests/v1/engine/test_step_sync.py",
        "tests/v1/engine/step_sync/test_protocol.py",
        "test_options_come_from_additional_config becomes a ParallelConfig/EngineArgs "
        "test (fields, default 'wave', bounds, one-line error for a bad value)",
    ),
    (
        "tests/v1/engine/test_step_sync_cores.py",
        "tests/v1/engine/step_sync/test_cores.py",
        "none beyond imports",
    ),
    (
        "tests/v1/engine/test_step_sync_healing.py",
        "tests/v1/engine/step_sync/test_healing.py",
        "none beyond imports",
    ),
    (
        "tests/v1/engine/test_step_sync_membership.py",
        "tests/v1/engine/step_sync/test_membership.py",
        "the external-LB server with a different option: "
        "--data-parallel-sync-lookahead instead of --additional-config",
    ),
    (
        "tests/v1/engine/test_step_sync_phases.py",
        "tests/v1/engine/step_sync/test_phases.py",
        "none beyond imports",
    ),
    (
        "tests/v1/engine/test_step_sync_clients.py",
        "tests/v1/engine/step_sync/test_clients.py",
        "PATCHES / patch.apply(): call make_client / make_async_mp_client with "
        "data_parallel_sync 'step' and 'wave' and assert the class picked",
    ),
    (
        "tests/v1/engine/test_step_sync_launch_modes.py",
        "tests/v1/engine/step_sync/test_launch_modes.py",
        "core_patches / PATCHES / load_patch_set: the selection in run_engine_core and "
        "CoreEngineActorManager by data_parallel_sync; SimpleNamespace configs gain "
        "the step-sync fields",
    ),
    (
        "tests/v1/distributed/test_step_sync_dp.py",
        "tests/v1/distributed/test_step_sync_dp.py",
        "servers get --data-parallel-sync step; metrics: vllm:step_sync_* by engine "
        "label (wave traffic: wave_messages_total; rejected: rejected_frames_total; "
        "pause violations are no metric in-tree); --additional-config options become "
        "flags; kv_connector_module_path of the test connector",
    ),
    (
        "tests/v1/distributed/test_step_sync_offline.py",
        "tests/v1/distributed/test_step_sync_offline.py",
        "LLM(..., data_parallel_sync='step'); cpu_test_env from the tests' helpers",
    ),
    (
        "tests/v1/distributed/test_step_sync_ray_dp.py",
        "tests/v1/distributed/test_step_sync_ray_dp.py",
        "--data-parallel-sync step; metrics by engine label",
    ),
)
DROPPED_TESTS: dict[str, str] = {
    "tests/v1/metrics/test_step_sync_metrics.py": (
        "tests the JSON snapshots, the collector and VLLM_DISAGG_METRICS_DIR, none of "
        "which is exported; replaced by a unit test of StepSyncStatsReporter and "
        "StepSyncProm (tests/v1/metrics/test_step_sync_stats.py)"
    ),
}

__all__ = [
    "ACTOR",
    "CLIENTS",
    "COORDINATOR_FIELD",
    "CREDENTIALS",
    "DROPPED",
    "DROPPED_TESTS",
    "EDITS",
    "ENGINE_CORE",
    "FIELD",
    "LOOKAHEAD_FIELD",
    "METRICS",
    "METRICS_PATH",
    "METRICS_SOURCE",
    "MOVES",
    "NEEDS",
    "OPTION_FIELDS",
    "REWRITES",
    "SLICE",
    "TESTS",
    "TEST_REWRITES",
    "TIMEOUT_FIELD",
    "UPSTREAM_SRC",
    "insert_after",
    "insert_field",
    "moved",
    "new_files",
    "rewrite",
    "select_subclass",
]
