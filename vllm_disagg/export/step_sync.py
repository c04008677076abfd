"""The step-sync slice of the export: what the step-sync commit of the tree holds.

Four parts, each data or code the tree driver runs:

* :data:`EDITS`: edits of upstream files (:class:`~vllm_disagg.export.edits.Edit`,
  anchored on qualified scopes, each matching once). ``ParallelConfig`` gets
  ``data_parallel_sync`` (``"wave"`` by default), the look-ahead and the peer
  timeout as fields; ``EngineArgs`` the matching fields and flags, and its
  ``create_engine_config`` prepares the group's secret; the four
  places 0.32 picks a DP class (``run_engine_core``, ``CoreEngineActorManager``,
  ``make_client``, ``make_async_mp_client``) pick the step-sync class for
  ``"step"``; ``launch_core_engines`` runs the DP coordinator without wave
  coordination for ``"step"``; ``SchedulerStats`` carries
  :data:`STATS_CLASS` to ``PrometheusStatLogger``.
* :data:`MOVES` / :data:`DROPPED`: which project modules go where (module
  prefixes, matched on module boundaries) and which are not exported.
* :data:`REWRITES`: step-sync-specific changes of the project's source, run on
  the project text *before* the generic relocation (they remove what refers
  to dropped modules, so what they write may already name upstream modules).
* :func:`new_files`: files the commit adds that are not a moved project
  module (the in-tree metrics module, written here).

:data:`TESTS` says which of the project's step-sync tests the commit carries
and what changes in them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from vllm_disagg.export import cst as anchors
from vllm_disagg.export import layout as L
from vllm_disagg.export.edit import Edit
from vllm_disagg.export.source import ExportError

SLICE = "step-sync"

# --- the names the tree uses --------------------------------------------------

FIELD = "data_parallel_sync"
LOOKAHEAD_FIELD = "data_parallel_sync_lookahead"
TIMEOUT_FIELD = "data_parallel_sync_peer_timeout_seconds"
# The plugin's --additional-config keys and what they become.
OPTION_FIELDS = {
    "step_sync_lookahead": LOOKAHEAD_FIELD,
    "step_sync_peer_timeout_s": TIMEOUT_FIELD,
}

ENGINE_CORE = "vllm.v1.engine.step_sync.engine_core"
CLIENTS = "vllm.v1.engine.step_sync.clients"
ACTOR = "vllm.v1.engine.step_sync.actor"
CREDENTIALS = "vllm.v1.engine.step_sync.credentials"
METRICS = "vllm.v1.metrics.step_sync"
METRICS_PATH = "vllm/v1/metrics/step_sync.py"
# Modules the export writes into vLLM's tree, by their upstream path.
UPSTREAM_SRC = Path(__file__).parent / "upstream_src"


# --- generic helpers (candidates for export/cst.py) ---------------------------


def insert_after(
    module: cst.Module,
    scope: str,
    matcher: m.BaseMatcherNode,
    new: Sequence[cst.BaseStatement],
    what: str,
    where: str,
    before: bool = False,
) -> cst.Module:
    """Put statements right after (or ``before``) the one statement of
    ``scope`` that ``matcher`` matches."""

    def place(node: cst.CSTNode):
        assert isinstance(node, cst.BaseStatement)
        return cst.FlattenSentinel([*new, node] if before else [node, *new])

    return anchors.replace_once(module, scope, matcher, place, what, where)


def insert_field(
    module: cst.Module,
    class_name: str,
    after: str,
    new: Sequence[cst.BaseStatement],
    where: str,
) -> cst.Module:
    """Add attributes to a class after the attribute ``after`` *and its
    docstring* (config classes document each field by the string after it)."""
    cls = anchors.find_scope(module, class_name, where)
    assert isinstance(cls, cst.ClassDef)
    body = list(cls.body.body)
    present = set().union(*(anchors._defined_names(s) for s in body))
    for stmt in new:
        for name in anchors._defined_names(stmt) & present:
            raise ExportError(f"{where}: {class_name}.{name} is defined already")
    hits = [i for i, s in enumerate(body) if after in anchors._defined_names(s)]
    if len(hits) != 1:
        raise ExportError(f"{where}: {class_name}.{after} is defined {len(hits)} times")
    index = hits[0] + 1
    if index < len(body) and m.matches(
        body[index],
        m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())]),
    ):
        index += 1
    body[index:index] = new
    return module.deep_replace(
        cls, cls.with_changes(body=cls.body.with_changes(body=body))
    )


def add_import_name(
    module: cst.Module, from_module: str, name: str, where: str
) -> cst.Module:
    """Add ``name`` to the one top-level ``from from_module import (...)``, in
    isort's order (case-insensitive, as upstream's ruff config sorts)."""
    matcher = m.ImportFrom(module=anchors.attribute_chain(from_module))

    def add(node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.ImportFrom) and not isinstance(
            node.names, cst.ImportStar
        )
        names = list(node.names)
        if any(a.evaluated_name == name for a in names):
            return node
        index = next(
            (i for i, a in enumerate(names) if a.evaluated_name.lower() > name.lower()),
            len(names),
        )
        if index == len(names):
            last = names[-1]
            names[-1] = last.with_changes(comma=names[0].comma)
            names.append(cst.ImportAlias(name=cst.Name(name), comma=last.comma))
        else:
            names.insert(
                index, cst.ImportAlias(name=cst.Name(name), comma=names[index].comma)
            )
            if index == len(names) - 2:  # before the last, whose comma may be absent
                names[index] = names[index].with_changes(comma=names[0].comma)
        return node.with_changes(names=names)

    return anchors.replace_once(
        module, "", matcher, add, f"from {from_module} import (...)", where
    )


def ensure_import_sorted(module: cst.Module, from_module: str, name: str, where: str):
    """Add ``from from_module import name`` among the module's top-level
    ``from vllm... import`` lines, before the first that sorts after it."""
    if anchors.defines(module, name):
        return module
    (stmt,) = anchors.statements(f"from {from_module} import {name}\n")
    body = list(module.body)
    top = from_module.split(".")[0]
    hits = []
    for i, s in enumerate(body):
        if m.matches(s, m.SimpleStatementLine(body=[m.ImportFrom()])):
            other = anchors.dotted(s.body[0].module)
            if other.split(".")[0] == top:
                hits.append((i, other))
    if not hits:
        raise ExportError(
            f"{where}: no top-level `from {top}... import` to place {name} among"
        )
    index = next((i for i, other in hits if other > from_module), hits[-1][0] + 1)
    body.insert(index, stmt)
    return module.with_changes(body=body)


def select_subclass(
    scope: str,
    class_name: str,
    condition: str,
    from_module: str,
    subclass: str,
    local: str,
) -> Callable[[cst.Module, str], cst.Module]:
    """At the one statement of ``scope`` that uses ``class_name`` (imports
    aside), choose the class in a local first::

        local: type[Cls] = Cls
        if <condition>:
            from <from_module> import <subclass>

            local = <subclass>
        <statement, with Cls replaced by local>

    The subclass module is imported where it is chosen: it imports the module
    being edited (no cycle), and only step-sync deployments load it."""

    def edit(module: cst.Module, where: str) -> cst.Module:
        scope_node = anchors.find_scope(module, scope, where)
        imports = m.findall(scope_node, m.ImportAlias(name=m.Name(class_name)))
        import_names = {id(a.name) for a in imports}
        uses = [
            n
            for n in m.findall(scope_node, m.Name(class_name))
            if id(n) not in import_names
        ]
        if len(uses) != 1:
            raise ExportError(
                f"{where}: {class_name} is used {len(uses)} times in {scope}, expected "
                "once"
            )
        (use,) = uses
        statements = [
            s
            for s in m.findall(scope_node, m.SimpleStatementLine())
            if m.findall(s, m.MatchIfTrue(lambda n: n is use))
        ]
        if len(statements) != 1:
            raise ExportError(
                f"{where}: no single statement uses {class_name} in {scope}"
            )
        (statement,) = statements
        chooser = anchors.statements(
            f"{local}: type[{class_name}] = {class_name}\n"
            f"if {condition}:\n"
            f"    from {from_module} import {subclass}\n\n"
            f"    {local} = {subclass}\n"
        )
        chooser[0] = chooser[0].with_changes(leading_lines=statement.leading_lines)
        renamed = statement.deep_replace(use, cst.Name(local)).with_changes(
            leading_lines=[]
        )
        return module.deep_replace(statement, cst.FlattenSentinel([*chooser, renamed]))

    return edit


# --- ParallelConfig -------------------------------------------------------------

_PARALLEL_FIELDS = f'''\
{FIELD}: DataParallelSync = "wave"
"""How MoE data parallel ranks stay in lockstep (they must run the same
    number of forward passes). "wave": waves started by the DP coordinator and
    an all-reduce every `dp_sync_interval` steps. "step": the ranks agree on a
    common step count among themselves (a coordinator thread in DP rank 0's
    engine core) and a rank without work runs dummy steps up to it: no waves,
    no all-reduce in the busy loop, and clients carry no DP state."""
{LOOKAHEAD_FIELD}: int = Field(default=2, ge=1, le=1024)
"""With `{FIELD}="step"`: how many steps beyond its own a rank
    with work asks for (renewed when half of them are left)."""
{TIMEOUT_FIELD}: float = Field(default=30.0, ge=0.1, le=3600)
"""With `{FIELD}="step"`: seconds after which a silent or
    stalled DP rank ends the group with an error instead of leaving its peers
    waiting."""
'''

_PARALLEL_CHECKS = f"""\
if self.{FIELD} == "step":
    for option in ("enable_elastic_ep", "enable_fault_tolerance"):
        if getattr(self, option):
            raise ValueError(
                f"{FIELD}='step' does not support {{option}} (it "
                "re-forms the DP group, not the step-sync group); use "
                "{FIELD}='wave'"
            )
"""


def _refuse_defined(module: cst.Module, name: str, where: str) -> None:
    if anchors.defines(module, name):
        raise ExportError(f"{where}: {name} is defined already")


def _parallel_config(module: cst.Module, where: str) -> cst.Module:
    _refuse_defined(module, "DataParallelSync", where)
    module = anchors.insert_after_top_level(
        module,
        "DataParallelBackend",
        anchors.statements('DataParallelSync = Literal["wave", "step"]\n'),
        where,
    )
    module = insert_field(
        module,
        "ParallelConfig",
        "dp_sync_interval",
        anchors.statements(_PARALLEL_FIELDS),
        where,
    )
    checks = anchors.statements(_PARALLEL_CHECKS)
    checks[0] = checks[0].with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    return insert_after(
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
    module = add_import_name(module, "vllm.config.parallel", "DataParallelSync", where)
    module = anchors.class_body_insert(
        module,
        "EngineArgs",
        anchors.statements(
            f"{FIELD}: DataParallelSync = ParallelConfig.{FIELD}\n"
            f"{LOOKAHEAD_FIELD}: int = ParallelConfig.{LOOKAHEAD_FIELD}\n"
            f"{TIMEOUT_FIELD}: float = ParallelConfig.{TIMEOUT_FIELD}\n"
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
            for name in (FIELD, LOOKAHEAD_FIELD, TIMEOUT_FIELD)
        )
    )
    module = insert_after(
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
            for name in (FIELD, LOOKAHEAD_FIELD, TIMEOUT_FIELD)
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
    return insert_after(
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

_run_engine_core = select_subclass(
    "EngineCoreProc.run_engine_core",
    "DPEngineCoreProc",
    _STEP,
    ENGINE_CORE,
    "StepSyncDPEngineCoreProc",
    "dp_engine_class",
)
_actor = select_subclass(
    "CoreEngineActorManager.__init__",
    "DPMoEEngineCoreActor",
    _STEP_V,
    ACTOR,
    "StepSyncDPMoEEngineCoreActor",
    "dp_actor_class",
)
_sync_client = select_subclass(
    "EngineCoreClient.make_client",
    "SyncMPClient",
    _STEP_V,
    CLIENTS,
    "StepSyncSyncMPClient",
    "sync_client_class",
)
_dp_client = select_subclass(
    "EngineCoreClient.make_async_mp_client",
    "DPAsyncMPClient",
    _STEP,
    CLIENTS,
    "StepSyncDPAsyncMPClient",
    "dp_client_class",
)
_dp_lb_client = select_subclass(
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

STATS_CLASS = '''\
@dataclass
class StepSyncStats:
    """Counters of a DP engine core with `--data-parallel-sync step`.

    The counts are increments since the engine core's previous report; the two
    steps are positions (every rank ends at the same coordinator step)."""

    forward_steps: int = 0
    """Real forward passes run."""
    dummy_steps: int = 0
    """Dummy forward passes run to keep up with the other DP ranks."""
    grant_waits: int = 0
    """Waits (one round trip at most) for a step this rank asked for: the
    wake-ups of an idle group."""
    rejected_frames: int = 0
    """Step-sync frames dropped as malformed, unauthenticated or replayed, by
    this rank and (DP rank 0) by the coordinator."""
    wave_messages: int = 0
    """DP wave traffic that crossed the engine core's boundary (START_DP_WAVE,
    requests stamped with a wave, outputs carrying one); expected 0."""
    local_step: int = 0
    """Forward passes (real and dummy) run so far."""
    coordinator_step: int = 0
    """The step count granted to every DP rank so far."""
'''

# vLLM's side of the step-sync metrics: a real module (ruff checks it), read
# at export time; it imports names the step-sync edits add to vLLM, so it only
# imports in the tree (the fork build's tests run it).
METRICS_SOURCE = UPSTREAM_SRC / METRICS_PATH


def _scheduler_stats(module: cst.Module, where: str) -> cst.Module:
    _refuse_defined(module, "StepSyncStats", where)
    new = anchors.statements(STATS_CLASS)
    new[0] = new[0].with_changes(
        leading_lines=[cst.EmptyLine(), cst.EmptyLine(indent=False)]
    )
    module = anchors.insert_after_top_level(module, "KV_FETCH_STAGES", new, where)
    return insert_field(
        module,
        "SchedulerStats",
        "perf_stats",
        anchors.statements("\nstep_sync_stats: StepSyncStats | None = None\n"),
        where,
    )


def _prometheus_logger(module: cst.Module, where: str) -> cst.Module:
    module = ensure_import_sorted(module, METRICS, "StepSyncProm", where)
    module = anchors.class_body_insert(
        module,
        "PrometheusStatLogger",
        anchors.statements("_step_sync_cls = StepSyncProm\n"),
        where,
        after="_perf_metrics_cls",
    )
    module = insert_after(
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
    return insert_after(
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
        f"{TIMEOUT_FIELD}, and what 'step' does not support",
        _parallel_config,
    ),
    Edit(
        "step-sync-options",
        "vllm/engine/arg_utils.py",
        "EngineArgs fields and --data-parallel-sync[-lookahead|-peer-timeout-seconds]; "
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
_WORDS = _replace_text(
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
            f"    lookahead=parallel_config.{LOOKAHEAD_FIELD},\n"
            f"    peer_timeout_s=parallel_config.{TIMEOUT_FIELD},\n"
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
# gets _WORDS.
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


def moved(module: str) -> str | None:
    """The upstream name of a project module this slice moves, or None."""
    for project, upstream in sorted(MOVES, key=lambda p: -len(p[0])):
        if module == project or module.startswith(project + "."):
            return upstream + module[len(project) :]
    return None


# --- test rewrites (project text, before relocation) -----------------------------

# The unit tests import their helpers as top-level modules (the project's
# tests/v1/engine is no package); upstream's tests/v1/engine is one.
_SIBLINGS = re.compile(r"^from (step_sync_helpers) import ", re.M)


def _sibling_imports(path: str, text: str) -> str:
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


def rewrite(module: str, path: str, text: str) -> str:
    """The step-sync rewrites of one project module or test (before
    relocation)."""
    if module.startswith("tests."):
        text = _sibling_imports(path, text)
        for fn in TEST_REWRITES.get(module, ()):
            text = fn(path, text)
        return _WORDS(path, text)
    if moved(module) is None:
        return text
    for fn in REWRITES.get(module, ()):
        text = fn(path, text)
    return _WORDS(path, text)


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
        "the three fields",
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
    "DROPPED",
    "DROPPED_TESTS",
    "EDITS",
    "MOVES",
    "NEEDS",
    "REWRITES",
    "TESTS",
    "insert_after",
    "insert_field",
    "moved",
    "new_files",
    "rewrite",
    "select_subclass",
]
