"""Forward-pass probe for benchmarks: counts, per DP rank, the passes an
engine core runs and the blocking DP collectives its busy loop makes.

It measures upstream (waves) and step sync alike, so the benchmark can put
both side by side. Off unless ``VLLM_DISAGG_PROBE=1``. Each engine-core
process writes ``probe_dp<rank>.json`` to ``VLLM_DISAGG_METRICS_DIR`` from a
background thread (every :data:`FLUSH_INTERVAL_S` while counts change).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from vllm_disagg import envs
from vllm_disagg.v1.metrics import read_json_files, write_json_atomically

FLUSH_INTERVAL_S = 0.1


class ForwardProbe:
    def __init__(self):
        self.dp_rank: int | None = None
        self.counts = {"real_passes": 0, "dummy_passes": 0, "blocking_collectives": 0}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def count(self, name: str, dp_rank: int | None = None) -> None:
        with self._lock:
            self.counts[name] += 1
            if dp_rank is not None:
                self.dp_rank = dp_rank
            if self._thread is None:
                self._thread = threading.Thread(target=self._flush_loop, daemon=True)
                self._thread.start()

    def _flush_loop(self) -> None:
        directory = envs.metrics_dir()
        if not directory:
            _logger().warning(
                "probe: %s unset, counts go nowhere", envs.VLLM_DISAGG_METRICS_DIR
            )
            return
        last, failing, announced = None, False, False
        while True:
            with self._lock:
                snapshot = dict(self.counts, dp_rank=self.dp_rank, pid=os.getpid())
            if snapshot != last and snapshot["dp_rank"] is not None:
                path = Path(directory) / f"probe_dp{snapshot['dp_rank']}.json"
                try:
                    write_json_atomically(path, snapshot)
                    last, failing = snapshot, False
                except OSError as e:  # measurement must never take the engine down
                    if not failing:
                        _logger().warning("probe: cannot write %s: %s", path, e)
                    failing = True
                if not announced:
                    # After the first write: the logger imports vLLM, which
                    # takes seconds on a loaded host; counts must not wait.
                    announced = True
                    _logger().info(
                        "probe: pid=%d writes its counts to %s", os.getpid(), directory
                    )
            time.sleep(FLUSH_INTERVAL_S)


def _logger():
    from vllm_disagg.logger import init_logger  # imports vLLM: not for readers

    return init_logger(__name__)


PROBE = ForwardProbe()


def read_probes(directory: str | os.PathLike) -> dict[int, dict[str, int]]:
    return {
        int(doc["dp_rank"]): doc for doc in read_json_files(directory, "probe_dp*.json")
    }
