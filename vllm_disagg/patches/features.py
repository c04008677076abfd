"""The patch registry's features and probes: what this project adds.

Features (step-synchronized DP, the P2pNcclConnector's options) are skipped
under ``VLLM_DISAGG_DISABLE=1``; probes only count (the benchmarks) and are
applied only with ``VLLM_DISAGG_PROBE=1``. Kept apart from the enablers
because these become the project's upstream changes, not fixes of upstream.
"""

from __future__ import annotations

from vllm_disagg.patches.record import InTree, Patch

FEATURES: tuple[Patch, ...] = (
    Patch(
        name="step-sync-dp-engine",
        module="vllm_disagg.patches.v1.engine.core",
        apply_fn="apply_step_sync",
        check_fn="is_step_sync_applied",
        used_fn="is_step_sync_used",
        upstream="vllm.v1.engine.core.DPEngineCoreProc",
        kind="feature",
        why=(
            "Upstream keeps MoE DP ranks in lockstep with waves: START_DP_WAVE "
            "wake-ups through the DP coordinator process, wave numbers on "
            "requests and outputs, and a blocking gloo all-reduce every "
            "dp_sync_interval steps; every front end or router must take part."
        ),
        how=(
            "run_engine_core picks the module global DPEngineCoreProc at call "
            "time; it is replaced by StepSyncDPEngineCoreProc (a subclass): a "
            "step-sync Coordinator thread in DP rank 0, a Participant per rank, "
            "a busy loop that runs real passes when scheduled and dummy passes "
            "while owed, add_request asking for steps when work reaches an idle "
            "rank (the group wakes without FIRST_REQ), pause/resume as a group "
            "phase, no all-reduce. Inside "
            "the subclass, per instance: scheduler.schedule is wrapped to ask "
            "for steps before a real pass, and the output queue is wrapped to "
            "count outputs carrying wave fields."
        ),
        drop_when=(
            "Upstream adopts step-synchronized DP (or an equivalent) in "
            "DPEngineCoreProc."
        ),
        in_tree=InTree(
            "edit",
            "The step-synchronized engine core is a new module; run_engine_core picks "
            'it instead of DPEngineCoreProc when data_parallel_sync is "step". Merging '
            "it into DPEngineCoreProc instead is the maintainers' call (about 300 "
            "more lines).",
        ),
        related=(
            "none known; vLLM 0.33.0 reworked the DP clients' wake-up (FIRST_REQ), "
            "which the export's drift check must report."
        ),
    ),
    Patch(
        name="step-sync-ray-actor",
        module="vllm_disagg.patches.v1.engine.core",
        apply_fn="apply_ray_actor",
        check_fn="is_ray_actor_applied",
        used_fn="is_step_sync_used",
        upstream="vllm.v1.engine.core.DPMoEEngineCoreActor (CoreEngineActorManager)",
        kind="feature",
        why=(
            "With --data-parallel-backend ray every MoE DP rank is a Ray actor "
            "of upstream's DPMoEEngineCoreActor, a subclass of upstream's "
            "DPEngineCoreProc whose __init__ calls the module global "
            "DPEngineCoreProc.__init__: once step-sync-dp-engine replaced that "
            "global, step sync's __init__ runs on a non-step-sync instance and "
            "super() raises TypeError, so no Ray DP server starts."
        ),
        how=(
            "CoreEngineActorManager imports DPMoEEngineCoreActor from "
            "vllm.v1.engine.core when it starts the actors; the module global "
            "is replaced by StepSyncDPMoEEngineCoreActor(EngineCoreActorMixin, "
            "StepSyncDPEngineCoreProc), which calls step sync's __init__ by "
            "name. Ray unpickles the class by reference in the actor process, "
            "importing this package; its __init__ applies and verifies the "
            "patch set first, as run_engine_core does for engine-core processes."
        ),
        drop_when=(
            "Upstream's DP engine classes take step sync (step-sync-dp-engine "
            "dropped), or DPMoEEngineCoreActor calls its own base class's __init__."
        ),
        in_tree=InTree(
            "edit",
            "CoreEngineActorManager picks the step-sync actor class when "
            'data_parallel_sync is "step".',
        ),
        related="none known.",
        also_changes=("vllm/v1/engine/utils.py",),
    ),
    Patch(
        name="step-sync-clients",
        module="vllm_disagg.patches.v1.engine.core_client",
        upstream=(
            "vllm.v1.engine.core_client.SyncMPClient / DPAsyncMPClient / "
            "DPLBAsyncMPClient"
        ),
        kind="feature",
        why=(
            "The DP clients stamp every request with the current wave and, "
            "when they believe the engines idle, send FIRST_REQ so the DP "
            "coordinator broadcasts START_DP_WAVE; with step sync the engines "
            "wake each other and nothing outside them may know about waves. "
            "The sync client of LLM (offline DP, one LLM per rank) sets "
            "engines_running on add_request and clears it only on an output "
            "carrying wave_complete, which step-sync engines never send: "
            "LLMEngine.has_unfinished_requests() ORs in dp_engines_running(), "
            "so generate() blocked forever in get_output() after its last "
            "request finished."
        ),
        how=(
            "EngineCoreClient.make_client (SyncMPClient) and "
            "make_async_mp_client (DPAsyncMPClient, DPLBAsyncMPClient) look "
            "the classes up as module globals at call time; they are replaced "
            "by subclasses whose add_request / add_request_async send the "
            "request and nothing else and whose dp_engines_running() is always "
            "False: step-sync engines run the passes their group owes by "
            "themselves, and a client waits only for its own requests."
        ),
        drop_when="Upstream clients stop carrying DP wave state.",
        in_tree=InTree(
            "edit",
            "make_client and make_async_mp_client pick the step-sync client classes "
            'when data_parallel_sync is "step".',
        ),
        related="none known.",
    ),
    Patch(
        name="step-sync-stats-only-coordinator",
        module="vllm_disagg.patches.v1.engine.utils",
        upstream="vllm.v1.engine.utils.DPCoordinator (launch_core_engines)",
        kind="feature",
        why=(
            "For MoE models launch_core_engines starts the DP coordinator "
            "process with wave coordination on: it tracks waves and sends "
            "START_DP_WAVE. Its other job, relaying load-balancing stats to "
            "the front ends, is still wanted."
        ),
        how=(
            "The module global DPCoordinator used by launch_core_engines is "
            "replaced by a subclass that always passes "
            "enable_wave_coordination=False (upstream's mode for dense models)."
        ),
        drop_when="Upstream no longer runs wave coordination for MoE models.",
        in_tree=InTree(
            "edit",
            "The stats-only DP coordinator becomes an argument: launch_core_engines "
            'enables wave coordination only for MoE with data_parallel_sync "wave".',
        ),
        related="none known.",
    ),
    Patch(
        name="step-sync-metrics",
        module="vllm_disagg.patches.entrypoints.serve.instrumentator.metrics",
        upstream="vllm.entrypoints.serve.instrumentator.metrics.get_prometheus_registry",
        kind="feature",
        why=(
            "Step-sync counters live in the engine-core processes; with one "
            "API server, /metrics is served from that process's own Prometheus "
            "registry and never sees them."
        ),
        how=(
            "attach_router builds /metrics from the registry this name returns; "
            "with one API server the wrapper adds a collector that reads the "
            "per-rank snapshots engine cores write to VLLM_DISAGG_METRICS_DIR. "
            "With several (prometheus multiprocess mode) it changes nothing: "
            "engine cores write multiprocess files themselves."
        ),
        drop_when="vLLM exports engine-core plugin metrics to /metrics itself.",
        in_tree=InTree(
            "hand",
            "Redone: the counters travel in SchedulerStats to vLLM's Prometheus logger "
            "instead of JSON files read by a collector in the API server.",
        ),
        related="none known.",
        also_changes=("vllm/v1/metrics/stats.py", "vllm/v1/metrics/loggers.py"),
    ),
    Patch(
        name="step-sync-options",
        module="vllm_disagg.patches.engine.arg_utils_step_sync",
        upstream="vllm.engine.arg_utils.EngineArgs.create_engine_config",
        kind="feature",
        why=(
            "The step-sync options (step_sync_* keys of --additional-config) "
            "are read in the engine cores; a bad value or a misspelt key would "
            "only fail there, behind the tracebacks of every DP rank. "
            "--enable-fault-tolerance cannot work with step sync: vLLM's "
            "fault-tolerance retry re-forms the DP group after a rank fails "
            "but not the step-sync group (and on CPU it cannot start at all: "
            "it needs the deepep_low_latency or nixl_ep all2all backend)."
        ),
        how=(
            "Adds check_step_sync_options to the checks the startup-validation "
            "wrapper of create_engine_config runs on the built config: the same "
            "StepSyncConfig.from_additional_config the engine cores call, and "
            "for an MoE model with DP > 1 a refusal of "
            "--enable-fault-tolerance, so `vllm serve` exits 2 with a message "
            "naming the key or flag (and VLLM_DISAGG_DISABLE=1 for upstream "
            "waves). The same hook prepares the group's secret "
            "(step_sync.credentials.prepare_launch): a fresh one, in the "
            "environment of the engine cores this process starts, when it starts "
            "every rank; otherwise separately started ranks beyond loopback "
            "without VLLM_DISAGG_DP_SECRET exit 2 here. Off with the other "
            "features under VLLM_DISAGG_DISABLE=1."
        ),
        drop_when="Step sync is upstream and vLLM validates its options itself.",
        in_tree=InTree(
            "hand",
            'data_parallel_sync ("wave" by default, or "step"), the look-ahead and the '
            "peer timeout become ParallelConfig fields with EngineArgs flags, and "
            "their checks move into ParallelConfig; EngineArgs.create_engine_config "
            "calls prepare_launch for the group's secret.",
        ),
        related="none known.",
        also_changes=("vllm/config/parallel.py",),
    ),
    Patch(
        name="p2p-kv-transfer-json",
        module="vllm_disagg.patches.engine.arg_utils_p2p",
        upstream=(
            "vllm.engine.arg_utils.EngineArgs.add_cli_args / __post_init__ / "
            "create_engine_config"
        ),
        kind="feature",
        why=(
            "Users select P2pNcclConnector with the seed design document's JSON, "
            "which puts kv_buffer_size (and the old kv_ip, kv_rank, "
            "kv_parallel_size) at the top level; 0.32's KVTransferConfig forbids "
            "unknown fields and has none of them, so `vllm serve "
            '--kv-transfer-config \'{..."kv_buffer_size":"1e1"...}\'` exits 2 at '
            'argument parsing with "kv_buffer_size: Unexpected keyword argument".'
        ),
        how=(
            "Wraps add_cli_args: the --kv-transfer-config argparse type (which the "
            "dotted --kv-transfer-config.key=value form also reaches) normalises "
            "P2pNcclConnector JSON with normalize_kv_transfer_json (legacy keys "
            "into kv_connector_extra_config, kv_load_failure_policy recompute by "
            "default), hands it to upstream's type, then parses P2pConfig so a bad "
            "value is one argparse error naming the key. A dict given to "
            "EngineArgs is normalised in the startup-validation wrappers of "
            "__post_init__ and create_engine_config, and check_p2p_config (port "
            "plan included) joins the checks on the built config. Other "
            "connectors' JSON reaches upstream untouched."
        ),
        drop_when=(
            "The connector is upstream with its options in kv_connector_extra_config "
            "(or KVTransferConfig has kv_buffer_size again) and vLLM validates them."
        ),
        in_tree=InTree(
            "hand",
            "The connector is registered in the connector factory; whether the legacy "
            "top-level keys (kv_buffer_size, kv_ip) get a KVTransferConfig validator "
            "or only documentation is for the maintainers to decide.",
        ),
        related=(
            "vllm-project/vllm#44854 removed upstream's P2pNcclConnector (for the "
            "reasons of #33115); this connector is a rewrite with its own tests."
        ),
        also_changes=(
            "vllm/config/kv_transfer.py",
            "vllm/distributed/kv_transfer/kv_connector/factory.py",
        ),
    ),
    Patch(
        name="forward-pass-probe",
        module="vllm_disagg.patches.v1.engine.core",
        apply_fn="apply_probe",
        check_fn="is_probe_applied",
        upstream="vllm.v1.engine.core.EngineCore.post_step / execute_dummy_batch",
        kind="probe",
        why=(
            "The benchmark compares how many real and dummy forward passes "
            "each DP rank runs with waves and with step sync; upstream exposes "
            "neither count."
        ),
        how=(
            "Wraps both methods to count (post_step(model_executed=True) is "
            "one real pass) and flushes the counts per DP rank to a JSON file."
        ),
        drop_when="Upstream exports real/dummy forward-pass counters per DP rank.",
        in_tree=InTree("dropped", "Measurement for the benchmarks only."),
        related="none: benchmark only.",
    ),
    Patch(
        name="dp-collective-probe",
        module="vllm_disagg.patches.config.parallel",
        upstream=(
            "vllm.config.parallel.ParallelConfig.sync_dp_state / has_unfinished_dp"
        ),
        kind="probe",
        why=(
            "The benchmark counts blocking collectives per 1000 steps; these "
            "two static methods are the all-reduces upstream's DP busy loop "
            "blocks on."
        ),
        how="Wraps both to count calls into the same probe as forward-pass-probe.",
        drop_when="Upstream exports a counter of DP-sync all-reduces.",
        in_tree=InTree(
            "dropped",
            "Measurement for the benchmarks only; vLLM 0.33.0 made sync_dp_state an "
            "instance method, so it would need redoing there anyway.",
        ),
        related="none: benchmark only.",
    ),
)
