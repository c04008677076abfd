"""The step-sync slice's rewrites of the project's text, run before the generic
relocation (:mod:`.relocate`): :data:`REWRITES` of its modules (they remove
what refers to modules that are not exported, so what they write may already
name upstream modules), :data:`TEST_REWRITES` of its tests, and the wording
every exported step-sync file shares (:data:`WORDS`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import libcst as cst
import libcst.matchers as m

from vllm_disagg.export import cst as anchors
from vllm_disagg.export.source import ExportError
from vllm_disagg.export.step_sync_edits import (
    COORDINATOR_FIELD,
    FIELD,
    LOOKAHEAD_FIELD,
    METRICS,
    TIMEOUT_FIELD,
)

# --- source rewrites (project text, before relocation) ---------------------------

Rewrite = Callable[[str, str], str]


def _module_edit(fn: Callable[[cst.Module, str], cst.Module]) -> Rewrite:
    def rewrite(path: str, text: str) -> str:
        return fn(anchors.parse(text, path), path).code

    rewrite.__name__ = fn.__name__
    return rewrite


def _replace_text(pairs: Sequence[tuple[str, str]], required: bool = True) -> Rewrite:
    def rewrite(path: str, text: str) -> str:
        for old, new in pairs:
            if required and old not in text:
                raise ExportError(
                    f"{path}: {old!r} not found (the step-sync rewrite is stale)"
                )
            text = text.replace(old, new)
        return text

    return rewrite


def _remove_statement(module: cst.Module, scope: str, matcher, what: str, where: str):
    return anchors.replace_once(
        module, scope, matcher, lambda node: cst.RemoveFromParent(), what, where
    )


def _import_from(module_name: str) -> m.SimpleStatementLine:
    return m.SimpleStatementLine(
        body=[m.ImportFrom(module=anchors.attribute_chain(module_name))]
    )


# The wording every exported step-sync module shares.
WORDS = _replace_text(
    (
        (
            "set VLLM_DISAGG_DISABLE=1 to use upstream DP waves",
            "use --data-parallel-sync wave",
        ),
        ("vllm_disagg/step_sync/", "vllm/step_sync/"),
        ("step_sync_peer_timeout_s", TIMEOUT_FIELD),
        ("step_sync_lookahead", LOOKAHEAD_FIELD),
    ),
    required=False,
)


def _engine_core(module: cst.Module, where: str) -> cst.Module:
    """The engine core reads its options from ParallelConfig and reports its
    counters in SchedulerStats."""
    scope = "StepSyncDPEngineCoreProc.__init__"
    module = anchors.replace_once(
        module,
        "",
        _import_from("vllm_disagg.v1.metrics.step_sync"),
        lambda node: anchors.statements(
            f"from {METRICS} import StepSyncStatsReporter\n"
        )[0],
        "the metrics writer's import",
        where,
    )
    module = anchors.replace_once(
        module,
        scope,
        m.Call(func=anchors.attribute_chain("StepSyncConfig.from_additional_config")),
        lambda node: cst.parse_expression(
            "StepSyncConfig(\n"
            "    parallel_config.data_parallel_size,\n"
            f'    lookahead=parallel_config.{LOOKAHEAD_FIELD} or "auto",\n'
            f"    peer_timeout_s=parallel_config.{TIMEOUT_FIELD},\n"
            f"    coordinator=parallel_config.{COORDINATOR_FIELD},\n"
            ")"
        ),
        "StepSyncConfig.from_additional_config(...)",
        where,
    )
    module = anchors.replace_once(
        module,
        scope,
        m.Call(func=m.Name("StepSyncMetricsWriter")),
        lambda node: cst.parse_expression(
            "StepSyncStatsReporter(self, self._metrics_snapshot)"
        ),
        "StepSyncMetricsWriter(...)",
        where,
    )
    # Elastic EP is refused by ParallelConfig's validation in-tree.
    module = _remove_statement(
        module,
        scope,
        m.If(test=anchors.attribute_chain("parallel_config.enable_elastic_ep")),
        "if parallel_config.enable_elastic_ep",
        where,
    )
    module = _remove_statement(
        module,
        "StepSyncDPEngineCoreProc.shutdown",
        m.SimpleStatementLine(
            body=[m.Expr(m.Call(func=anchors.attribute_chain("self._metrics.close")))]
        ),
        "self._metrics.close()",
        where,
    )
    old = anchors.attribute_chain("self._metrics.maybe_write")
    if not m.findall(module, old):
        raise ExportError(f"{where}: self._metrics.maybe_write is not called")
    # One at a time: a replacement makes a new tree, so nodes found before it
    # may no longer be in the module.
    while calls := m.findall(module, old):
        module = module.deep_replace(
            calls[0], cst.parse_expression("self._metrics.maybe_report")
        )
    return module


def _engine_core_text(path: str, text: str) -> str:
    return _replace_text(
        (
            ('"vllm_disagg: step sync DP engine core', '"step sync DP engine core'),
            (
                "``StepSyncDPEngineCoreProc`` "
                "replaces upstream's ``DPEngineCoreProc``.",
                "``StepSyncDPEngineCoreProc`` runs instead of ``DPEngineCoreProc`` "
                "when\n"
                '``--data-parallel-sync step`` is set (the default, "wave", keeps it).',
            ),
        )
    )(path, text)


def _actor(module: cst.Module, where: str) -> cst.Module:
    """No patch set to load in a Ray actor of an in-tree build."""
    module = _remove_statement(
        module, "", _import_from("vllm_disagg.plugin"), "the plugin's import", where
    )
    module = _remove_statement(
        module,
        "StepSyncDPMoEEngineCoreActor.__init__",
        m.SimpleStatementLine(body=[m.Expr(m.Call(func=m.Name("load_patch_set")))]),
        "load_patch_set(...)",
        where,
    )
    docstring = anchors.statements(
        '"""The step-sync DP engine core as a Ray actor (``--data-parallel-backend '
        "ray``).\n\n"
        "``CoreEngineActorManager`` starts one actor of this class per DP rank of\n"
        "an MoE model when ``--data-parallel-sync step`` is set. Upstream's\n"
        "``DPMoEEngineCoreActor`` calls ``DPEngineCoreProc.__init__`` by name; this\n"
        "class calls ``StepSyncDPEngineCoreProc.__init__``.\n"
        '"""\n'
    )[0]
    first = module.body[0]
    if not m.matches(first, m.SimpleStatementLine(body=[m.Expr(m.SimpleString())])):
        raise ExportError(f"{where}: no module docstring")
    return module.with_changes(body=[docstring, *module.body[1:]])


def _config(module: cst.Module, where: str) -> cst.Module:
    """Options come from ParallelConfig fields, not --additional-config."""
    module = _remove_statement(
        module,
        "StepSyncConfig",
        m.FunctionDef(name=m.Name("from_additional_config")),
        "StepSyncConfig.from_additional_config",
        where,
    )
    return _remove_statement(
        module,
        "",
        m.SimpleStatementLine(
            body=[m.Assign(targets=[m.AssignTarget(m.Name("OPTION_KEYS"))])]
        ),
        "OPTION_KEYS = ...",
        where,
    )


def _package(module: cst.Module, where: str) -> cst.Module:
    """OPTION_KEYS (the --additional-config keys) is gone."""

    class Drop(cst.CSTTransformer):
        def leave_ImportAlias(self, original, updated):
            if m.matches(updated, m.ImportAlias(name=m.Name("OPTION_KEYS"))):
                return cst.RemoveFromParent()
            return updated

        def leave_Element(self, original, updated):
            if m.matches(updated.value, m.SimpleString('"OPTION_KEYS"')):
                return cst.RemoveFromParent()
            return updated

    new = module.visit(Drop())
    if new.code == module.code:
        raise ExportError(f"{where}: OPTION_KEYS not found")
    return new


def _participant(module: cst.Module, where: str) -> cst.Module:
    """Stack dumps of a stalled rank: this process's threads only, with the
    standard library (the plugin's diagnostics also signal the workers)."""
    module = anchors.replace_once(
        module,
        "Participant._run",
        m.SimpleStatementLine(
            body=[
                m.ImportFrom(module=anchors.attribute_chain("vllm_disagg.diagnostics"))
            ]
        ),
        lambda node: anchors.statements("import faulthandler\n")[0],
        "from vllm_disagg.diagnostics import dump_stacks",
        where,
    )
    return anchors.replace_once(
        module,
        "Participant._run",
        m.Call(func=m.Name("dump_stacks")),
        lambda node: cst.parse_expression(
            "faulthandler.dump_traceback(all_threads=True)"
        ),
        "dump_stacks(...)",
        where,
    )


# Messages that name the plugin's --additional-config keys: in-tree they name
# the ParallelConfig fields (longer, so the strings are split anew) and flags.
_COORDINATOR_TEXT = _replace_text(
    (
        (
            '                f"{msg.dp_size} step_sync_lookahead={msg.lookahead}, DP '
            'rank 0 has "\n'
            '                f"data_parallel_size={cfg.dp_size} step_sync_lookahead='
            '{cfg.lookahead} "\n'
            '                "(every rank needs the same --data-parallel-size and "\n'
            '                "--additional-config)"',
            '                f"{msg.dp_size} step_sync_lookahead={msg.lookahead}, "\n'
            '                f"DP rank 0 has data_parallel_size={cfg.dp_size} "\n'
            '                f"step_sync_lookahead={cfg.lookahead} "\n'
            '                "(every rank needs the same --data-parallel-size and "\n'
            '                "--data-parallel-sync-lookahead)"',
        ),
        (
            '                "(step_sync_peer_timeout_s); every rank must start with '
            'the same "\n'
            '                "--data-parallel-size, --data-parallel-address and '
            '--additional-config"',
            '                "(step_sync_peer_timeout_s); every rank must start "\n'
            '                "with the same --data-parallel-size, '
            '--data-parallel-address and "\n'
            '                "--data-parallel-sync-* options"',
        ),
    )
)
_ENGINE_CORE_COMMENT = _replace_text(
    (
        (
            "# Extra time a rank gives the group to form, beyond "
            "step_sync_peer_timeout_s\n"
            "# (the coordinator's own registration deadline), before it gives up "
            "itself.",
            "# Extra time a rank gives the group to form, beyond\n"
            "# step_sync_peer_timeout_s (the coordinator's own registration "
            "deadline),\n"
            "# before it gives up itself.",
        ),
    )
)

# project module -> rewrites, in order. Every exported step-sync module also
# gets WORDS.
REWRITES: dict[str, tuple[Rewrite, ...]] = {
    "vllm_disagg.v1.engine.core": (
        _module_edit(_engine_core),
        _engine_core_text,
        _ENGINE_CORE_COMMENT,
    ),
    "vllm_disagg.v1.engine.step_sync.coordinator_core": (_COORDINATOR_TEXT,),
    "vllm_disagg.v1.engine.core_actor": (_module_edit(_actor),),
    "vllm_disagg.v1.engine.step_sync.config": (_module_edit(_config),),
    "vllm_disagg.v1.engine.step_sync": (_module_edit(_package),),
    "vllm_disagg.v1.engine.step_sync.participant": (_module_edit(_participant),),
}


# --- test rewrites (project text, before relocation) -----------------------------

# The unit tests import their helpers as top-level modules (the project's
# tests/v1/engine is no package); upstream's tests/v1/engine is one.
_SIBLINGS = re.compile(r"^from (step_sync_helpers) import ", re.M)


def sibling_imports(path: str, text: str) -> str:
    return _SIBLINGS.sub(r"from .\1 import ", text)


_ENGINE_METRICS = _replace_text(
    # The engine core's metrics object has maybe_report() in-tree.
    (
        (
            "    def maybe_write(self, force: bool = False):",
            "    def maybe_report(self, force: bool = False):",
        ),
    )
)

_LAUNCH_MODES = _replace_text(
    (
        (
            "These tests check, without Ray\n"
            "or a model, that with the ``step-sync-ray-actor`` patch that class is a "
            "step\n"
            "sync engine core, that its ``__init__`` runs step sync's ``__init__`` on\n"
            "itself (upstream's calls the patched module global on an instance of the\n"
            "wrong class: ``TypeError``), and that a Ray worker process can load it "
            "by\n"
            "reference and gets the patch set applied.",
            "These tests check, without Ray\n"
            "or a model, that with ``--data-parallel-sync step`` the manager starts "
            "the\n"
            "step-sync actor class, that its ``__init__`` runs step sync's "
            "``__init__`` on\n"
            "itself.",
        ),
        # The actor class is the step-sync one itself (no patch to apply), and
        # an in-tree Ray worker loads no patch set.
        (
            "def test_actor_init_runs_step_sync_init_on_itself(monkeypatch, "
            "ray_actor_patch):",
            "def test_actor_init_runs_step_sync_init_on_itself(monkeypatch):",
        ),
        (
            """    calls = []

    def load_patch_set(config, dp_rank, process):
        calls.append(("patches", dp_rank))

    monkeypatch.setattr(core_actor, "load_patch_set", load_patch_set)
""",
            "    calls = []\n",
        ),
        (
            "    actor_class = upstream_core.DPMoEEngineCoreActor\n",
            "    actor_class = StepSyncDPMoEEngineCoreActor\n",
        ),
        ('        ("patches", 1),\n', ""),
        # CoreEngineActorManager picks the class by the config field.
        (
            "def test_upstream_ray_launch_path_starts_the_step_sync_actor(\n"
            "    monkeypatch, ray_actor_patch\n):",
            "def test_upstream_ray_launch_path_starts_the_step_sync_actor("
            "monkeypatch):",
        ),
        (
            "        enable_elastic_ep=False,\n        placement_group=None,\n",
            "        enable_elastic_ep=False,\n        placement_group=None,\n"
            f'        {FIELD}="step",\n',
        ),
        # The engine core reads its options from ParallelConfig.
        (
            "        data_parallel_rank=0,\n    )\n",
            "        data_parallel_rank=0,\n"
            f"        {LOOKAHEAD_FIELD}=2,\n"
            f"        {TIMEOUT_FIELD}=30.0,\n"
            f'        {COORDINATOR_FIELD}="auto",\n'
            "    )\n",
        ),
    )
)

_CLIENTS = _replace_text(
    (
        (
            "Engine clients keep no wave state (patch ``step-sync-clients``)",
            "The step-sync engine clients keep no wave state",
        ),
        ("from vllm_disagg.patches import PATCHES\n", ""),
        ("from vllm_disagg.patches.v1.engine import core_client as patch\n", ""),
        (
            "Upstream's class even when the patch is applied in this process.",
            "Upstream's class (what data_parallel_sync 'wave' uses).",
        ),
        ("The failure this patch removes", "The failure the step-sync client avoids"),
    )
)

_MEMBERSHIP = _replace_text(
    (
        (
            "started with a different --additional-config.",
            "started with another --data-parallel-sync-lookahead.",
        ),
    )
)

# project test module -> rewrites, in order (after the sibling imports).
TEST_REWRITES: dict[str, tuple[Rewrite, ...]] = {
    "tests.v1.engine.step_sync_helpers": (_ENGINE_METRICS,),
    "tests.v1.engine.test_step_sync_launch_modes": (_LAUNCH_MODES,),
    "tests.v1.engine.test_step_sync_clients": (_CLIENTS,),
    "tests.v1.engine.test_step_sync_membership": (_MEMBERSHIP,),
}
