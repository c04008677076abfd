"""The step-sync slice's edits of upstream files (:data:`EDITS`) and the names
they give the tree.

``ParallelConfig`` gets ``data_parallel_sync`` (``"wave"`` by default), the
look-ahead and the peer timeout as fields; ``EngineArgs`` the matching fields
and flags, and its ``create_engine_config`` prepares the group's secret; the
four places 0.32 picks a DP class (``run_engine_core``,
``CoreEngineActorManager``, ``make_client``, ``make_async_mp_client``) pick the
step-sync class for ``"step"``; ``launch_core_engines`` runs the DP coordinator
without wave coordination for ``"step"``; ``SchedulerStats`` carries
``StepSyncStats`` to ``PrometheusStatLogger``. Each edit is anchored on
qualified scopes and matches once (:mod:`.cst`).
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import libcst.matchers as m

from vllm_disagg.export import cst as anchors
from vllm_disagg.export.edit import Edit
from vllm_disagg.export.source import ExportError
from vllm_disagg.export.step_sync_fragments import fragment

SLICE = "step-sync"

# --- the names the tree uses --------------------------------------------------

FIELD = "data_parallel_sync"
LOOKAHEAD_FIELD = "data_parallel_sync_lookahead"
TIMEOUT_FIELD = "data_parallel_sync_peer_timeout_seconds"
COORDINATOR_FIELD = "data_parallel_sync_coordinator"
# The options after data_parallel_sync, in the order of their fields and flags.
OPTION_NAMES = (LOOKAHEAD_FIELD, TIMEOUT_FIELD, COORDINATOR_FIELD)
# The plugin's --additional-config keys and what they become.
OPTION_FIELDS = {
    "step_sync_lookahead": LOOKAHEAD_FIELD,
    "step_sync_peer_timeout_s": TIMEOUT_FIELD,
    "step_sync_coordinator": COORDINATOR_FIELD,
}

ENGINE_CORE = "vllm.v1.engine.step_sync.engine_core"
CLIENTS = "vllm.v1.engine.step_sync.clients"
ACTOR = "vllm.v1.engine.step_sync.actor"
CREDENTIALS = "vllm.v1.engine.step_sync.credentials"
METRICS = "vllm.v1.metrics.step_sync"
METRICS_PATH = "vllm/v1/metrics/step_sync.py"
# Modules the export writes into vLLM's tree, by their upstream path.
UPSTREAM_SRC = Path(__file__).parent / "upstream_src"


# --- ParallelConfig -------------------------------------------------------------


def _fields(carrier: str) -> list[cst.BaseStatement]:
    """The carrier's fields, which must be the four this slice names."""
    fields = fragment(carrier, body=True)
    names = set().union(*(anchors._defined_names(s) for s in fields))
    if names != {FIELD, *OPTION_NAMES}:
        raise ExportError(f"step_sync_fragments.{carrier} defines {sorted(names)}")
    return fields


def _refuse_defined(module: cst.Module, name: str, where: str) -> None:
    if anchors.defines(module, name):
        raise ExportError(f"{where}: {name} is defined already")


def _parallel_config(module: cst.Module, where: str) -> cst.Module:
    for name in ("DataParallelSync", "DataParallelSyncCoordinator"):
        _refuse_defined(module, name, where)
    module = anchors.insert_after_top_level(
        module,
        "DataParallelBackend",
        [
            *fragment("DataParallelSync"),
            *(
                s.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
                for s in fragment("DataParallelSyncCoordinator")
            ),
        ],
        where,
    )
    module = anchors.insert_field(
        module,
        "ParallelConfig",
        "dp_sync_interval",
        _fields("ParallelConfig"),
        where,
    )
    checks = fragment("ParallelConfig._validate_parallel_config", body=True)
    checks[0] = checks[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    return anchors.insert_after(
        module,
        "ParallelConfig._validate_parallel_config",
        m.SimpleStatementLine(body=[m.Return(m.Name("self"))]),
        checks,
        "return self",
        where,
        before=True,
    )


# --- EngineArgs -------------------------------------------------------------------


def _engine_args(module: cst.Module, where: str) -> cst.Module:
    for name in ("DataParallelSync", "DataParallelSyncCoordinator"):
        module = anchors.add_import_name(module, "vllm.config.parallel", name, where)
    module = anchors.class_body_insert(
        module,
        "EngineArgs",
        anchors.statements(
            f"{FIELD}: DataParallelSync = ParallelConfig.{FIELD}\n"
            f"{LOOKAHEAD_FIELD}: int | None = ParallelConfig.{LOOKAHEAD_FIELD}\n"
            f"{TIMEOUT_FIELD}: float = ParallelConfig.{TIMEOUT_FIELD}\n"
            f"{COORDINATOR_FIELD}: DataParallelSyncCoordinator = "
            f"ParallelConfig.{COORDINATOR_FIELD}\n"
        ),
        where,
        after="dp_sync_interval",
    )
    # A Python caller's bad value is one line here; ParallelConfig's Literal
    # would say it in pydantic's several. The CLI has argparse choices.
    check = anchors.statements(
        f"if self.{FIELD} not in get_args(DataParallelSync):\n"
        f"    raise ValueError(\n"
        f'        f"{FIELD} must be one of "\n'
        f"        f\"{{', '.join(get_args(DataParallelSync))}}, \"\n"
        f'        f"got {{self.{FIELD}!r}}"\n'
        f"    )\n"
    )
    post_init = anchors.find_scope(module, "EngineArgs.__post_init__", where)
    assert isinstance(post_init, cst.FunctionDef)
    body = post_init.body.with_changes(body=[*check, *post_init.body.body])
    module = module.deep_replace(post_init, post_init.with_changes(body=body))
    flags = anchors.statements(
        "".join(
            f'parallel_group.add_argument("--{name.replace("_", "-")}", '
            f'**parallel_kwargs["{name}"])\n'
            for name in (FIELD, *OPTION_NAMES)
        )
    )
    module = anchors.insert_after(
        module,
        "EngineArgs.add_cli_args",
        m.SimpleStatementLine(
            body=[
                m.Expr(
                    m.Call(
                        func=anchors.attribute_chain("parallel_group.add_argument"),
                        args=[
                            m.Arg(m.SimpleString('"--dp-sync-interval"')),
                            m.ZeroOrMore(),
                        ],
                    )
                )
            ]
        ),
        flags,
        "parallel_group.add_argument('--dp-sync-interval', ...)",
        where,
    )

    def pass_fields(node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.Call)
        args = list(node.args)
        index = next(
            i
            for i, a in enumerate(args)
            if a.keyword and a.keyword.value == "dp_sync_interval"
        )
        new = [
            cst.Arg(
                keyword=cst.Name(name),
                value=cst.parse_expression(f"self.{name}"),
                equal=args[index].equal,
                comma=args[index].comma,
            )
            for name in (FIELD, *OPTION_NAMES)
        ]
        args[index + 1 : index + 1] = new
        return node.with_changes(args=args)

    module = anchors.replace_once(
        module,
        "EngineArgs.create_engine_config",
        m.Call(
            func=m.Name("ParallelConfig"),
            args=[
                m.ZeroOrMore(),
                m.Arg(keyword=m.Name("dp_sync_interval")),
                m.ZeroOrMore(),
            ],
        ),
        pass_fields,
        "ParallelConfig(..., dp_sync_interval=...)",
        where,
    )
    # The process that built the config starts the engine cores: it hands
    # them the step-sync group's secret (credentials.prepare_launch), as the
    # plugin's create_engine_config hook does.
    prepare = anchors.statements(
        "if (\n"
        f'    config.parallel_config.{FIELD} == "step"\n'
        "    and config.model_config.is_moe\n"
        "    and config.parallel_config.data_parallel_size > 1\n"
        "):\n"
        f"    from {CREDENTIALS} import prepare_launch\n"
        "\n"
        "    prepare_launch(config.parallel_config)\n"
    )
    return anchors.insert_after(
        module,
        "EngineArgs.create_engine_config",
        m.SimpleStatementLine(body=[m.Return(value=m.Name("config"))]),
        prepare,
        "return config",
        where,
        before=True,
    )


# --- where 0.32 picks a DP class --------------------------------------------------

_STEP = f'parallel_config.{FIELD} == "step"'
_STEP_V = f'vllm_config.parallel_config.{FIELD} == "step"'

_run_engine_core = anchors.select_subclass(
    "EngineCoreProc.run_engine_core",
    "DPEngineCoreProc",
    _STEP,
    ENGINE_CORE,
    "StepSyncDPEngineCoreProc",
    "dp_engine_class",
)
_actor = anchors.select_subclass(
    "CoreEngineActorManager.__init__",
    "DPMoEEngineCoreActor",
    _STEP_V,
    ACTOR,
    "StepSyncDPMoEEngineCoreActor",
    "dp_actor_class",
)
_sync_client = anchors.select_subclass(
    "EngineCoreClient.make_client",
    "SyncMPClient",
    _STEP_V,
    CLIENTS,
    "StepSyncSyncMPClient",
    "sync_client_class",
)
_dp_client = anchors.select_subclass(
    "EngineCoreClient.make_async_mp_client",
    "DPAsyncMPClient",
    _STEP,
    CLIENTS,
    "StepSyncDPAsyncMPClient",
    "dp_client_class",
)
_dp_lb_client = anchors.select_subclass(
    "EngineCoreClient.make_async_mp_client",
    "DPLBAsyncMPClient",
    _STEP,
    CLIENTS,
    "StepSyncDPLBAsyncMPClient",
    "dp_lb_client_class",
)


def _clients(module: cst.Module, where: str) -> cst.Module:
    for edit in (_sync_client, _dp_client, _dp_lb_client):
        module = edit(module, where)
    return module


def _coordinator(module: cst.Module, where: str) -> cst.Module:
    """The DP coordinator coordinates waves only for MoE with "wave"; for
    "step" it only relays load-balancing stats (as for dense models)."""

    def only_for_waves(node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.Arg)
        value = cst.parse_expression(
            f'{anchors.dotted(node.value)} and parallel_config.{FIELD} == "wave"'
        )
        return node.with_changes(value=value)

    return anchors.replace_once(
        module,
        "launch_core_engines",
        m.Arg(
            keyword=m.Name("enable_wave_coordination"),
            value=anchors.attribute_chain("vllm_config.model_config.is_moe"),
        ),
        only_for_waves,
        "DPCoordinator(enable_wave_coordination=...)",
        where,
    )


# --- metrics: SchedulerStats -> PrometheusStatLogger ------------------------------

# vLLM's side of the step-sync metrics: a real module (ruff checks it), read
# at export time; it imports names the step-sync edits add to vLLM, so it only
# imports in the tree (the fork build's tests run it).
METRICS_SOURCE = UPSTREAM_SRC / METRICS_PATH


def _scheduler_stats(module: cst.Module, where: str) -> cst.Module:
    _refuse_defined(module, "StepSyncStats", where)
    new = fragment("StepSyncStats")
    new[0] = new[0].with_changes(
        leading_lines=[cst.EmptyLine(), cst.EmptyLine(indent=False)]
    )
    module = anchors.insert_after_top_level(module, "KV_FETCH_STAGES", new, where)
    return anchors.insert_field(
        module,
        "SchedulerStats",
        "perf_stats",
        anchors.statements("\nstep_sync_stats: StepSyncStats | None = None\n"),
        where,
    )


def _prometheus_logger(module: cst.Module, where: str) -> cst.Module:
    module = anchors.ensure_import_sorted(module, METRICS, "StepSyncProm", where)
    module = anchors.class_body_insert(
        module,
        "PrometheusStatLogger",
        anchors.statements("_step_sync_cls = StepSyncProm\n"),
        where,
        after="_perf_metrics_cls",
    )
    module = anchors.insert_after(
        module,
        "PrometheusStatLogger.__init__",
        m.SimpleStatementLine(
            body=[
                m.Assign(
                    targets=[
                        m.AssignTarget(
                            anchors.attribute_chain("self.perf_metrics_prom")
                        )
                    ]
                )
            ]
        ),
        anchors.statements(
            "self.step_sync_prom = (\n"
            "    self._step_sync_cls(labelnames, per_engine_labelvalues)\n"
            f'    if vllm_config.parallel_config.{FIELD} == "step"\n'
            "    else None\n"
            ")\n"
        ),
        "self.perf_metrics_prom = ...",
        where,
    )
    observe = anchors.statements(
        "if (\n"
        "    scheduler_stats.step_sync_stats is not None\n"
        "    and self.step_sync_prom is not None\n"
        "):\n"
        "    self.step_sync_prom.observe(scheduler_stats.step_sync_stats, engine_idx)\n"
    )
    observe[0] = observe[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    return anchors.insert_after(
        module,
        "PrometheusStatLogger.record",
        m.If(
            test=m.Comparison(
                left=anchors.attribute_chain("scheduler_stats.perf_stats"),
                comparisons=[m.ComparisonTarget(m.IsNot(), m.Name("None"))],
            )
        ),
        observe,
        "if scheduler_stats.perf_stats is not None",
        where,
    )


EDITS: tuple[Edit, ...] = (
    Edit(
        "step-sync-options",
        "vllm/config/parallel.py",
        f"ParallelConfig.{FIELD} ('wave' or 'step'), {LOOKAHEAD_FIELD}, "
        f"{TIMEOUT_FIELD}, {COORDINATOR_FIELD}, and what 'step' does not support",
        _parallel_config,
    ),
    Edit(
        "step-sync-options",
        "vllm/engine/arg_utils.py",
        "EngineArgs fields and "
        "--data-parallel-sync[-lookahead|-peer-timeout-seconds|-coordinator]; "
        "create_engine_config prepares the step-sync group's secret",
        _engine_args,
    ),
    Edit(
        "step-sync-dp-engine",
        "vllm/v1/engine/core.py",
        'run_engine_core: StepSyncDPEngineCoreProc for data_parallel_sync "step"',
        _run_engine_core,
    ),
    Edit(
        "step-sync-ray-actor",
        "vllm/v1/engine/utils.py",
        "CoreEngineActorManager: StepSyncDPMoEEngineCoreActor for data_parallel_sync "
        '"step"',
        _actor,
    ),
    Edit(
        "step-sync-stats-only-coordinator",
        "vllm/v1/engine/utils.py",
        "launch_core_engines: wave coordination only for MoE with data_parallel_sync "
        '"wave"',
        _coordinator,
    ),
    Edit(
        "step-sync-clients",
        "vllm/v1/engine/core_client.py",
        'make_client / make_async_mp_client: the step-sync clients for "step"',
        _clients,
    ),
    Edit(
        "step-sync-metrics",
        "vllm/v1/metrics/stats.py",
        "SchedulerStats.step_sync_stats (StepSyncStats)",
        _scheduler_stats,
    ),
    Edit(
        "step-sync-metrics",
        "vllm/v1/metrics/loggers.py",
        "PrometheusStatLogger exports StepSyncStats as vllm:step_sync_*",
        _prometheus_logger,
    ),
)
