"""The forward-pass probe's counts reach the directory the benchmark reads,
without a server: the benchmark's environment, the ``vllm`` command, and
engine-core stand-ins that count as the probe patches do.

benchmarks/step_sync_dp.py starts each server with ``VLLM_DISAGG_PROBE=1`` and
its own ``VLLM_DISAGG_METRICS_DIR`` and reads ``probe_dp<rank>.json`` there
(:func:`read_probes`); the engine cores write to whatever directory the
``vllm`` command hands them. When the command replaced the benchmark's
directory with a fresh temporary one, the benchmark read nothing and stopped
in warm-up with "probe counts did not settle: {}".
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from vllm_disagg import envs
from vllm_disagg.testing.server import cpu_test_env
from vllm_disagg.v1.metrics.probe import read_probes

# The `vllm` command, with upstream's main replaced by what `vllm serve
# --data-parallel-size 2` does here: start an engine-core process per DP rank
# (inheriting the command's environment) that counts passes into the probe.
COMMAND = textwrap.dedent(
    """
    import subprocess, sys
    import vllm_disagg.entrypoints.cli.main as cli
    import vllm.entrypoints.cli.main as upstream

    ENGINE_CORE = '''
    import json, sys, time
    from pathlib import Path
    from vllm_disagg import envs
    from vllm_disagg.v1.metrics.probe import PROBE

    rank = int(sys.argv[1])
    for _ in range(3):
        PROBE.count("real_passes", rank)
    PROBE.count("dummy_passes", rank)
    PROBE.count("blocking_collectives")
    written = Path(envs.metrics_dir()) / f"probe_dp{rank}.json"
    deadline = time.monotonic() + 60
    # The flush thread is a daemon: an engine outlives it, this stand-in must
    # stay until its last counts were written (the first write may hold only
    # the first count, and the next waits for the logger's vLLM import).
    while time.monotonic() < deadline:
        try:
            if json.loads(written.read_text())["blocking_collectives"] == 1:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    '''

    def serve():
        cores = [
            subprocess.Popen([sys.executable, "-c", ENGINE_CORE, str(rank)])
            for rank in (0, 1)
        ]
        return max(core.wait(timeout=60) for core in cores)

    upstream.main = serve
    sys.exit(cli.main())
    """
)


def test_probe_counts_reach_the_directory_the_benchmark_reads(tmp_path):
    metrics_dir = tmp_path / "metrics-step_sync"
    metrics_dir.mkdir()
    # As ModeUnderTest builds a server's environment in benchmarks/step_sync_dp.py.
    env = cpu_test_env(
        **{envs.VLLM_DISAGG_PROBE: "1", envs.VLLM_DISAGG_METRICS_DIR: str(metrics_dir)}
    )
    subprocess.run([sys.executable, "-c", COMMAND], env=env, timeout=180, check=True)
    counts = read_probes(metrics_dir)
    assert sorted(counts) == [0, 1], sorted(p.name for p in metrics_dir.iterdir())
    for rank in (0, 1):
        assert counts[rank]["dp_rank"] == rank
        assert counts[rank]["real_passes"] == 3
        assert counts[rank]["dummy_passes"] == 1
        assert counts[rank]["blocking_collectives"] == 1
