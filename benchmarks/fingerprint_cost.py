"""What the model fingerprint costs at start, for 1, 10 and 100 GB of weights.

The fingerprint (vllm_disagg/.../p2p/fingerprint.py) hashes every weight
file once (SHA-256), unless a Hugging Face hub snapshot names the file's
blob by its hash already, and caches the result beside the files. This
measures, in one run on this machine: the first start (the files hashed,
from the page cache: vLLM has just read them to load the model), a restart
(the cache read), and a hub snapshot (no hashing), over ``--gib`` GiB of
weight files; and extrapolates the first start to 1, 10 and 100 GB from the
measured throughput. Writes benchmarks/results/fingerprint_cost.{json,md}.

    .venv/bin/python benchmarks/fingerprint_cost.py [--gib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from _deps import (  # benchmarks/_deps.py: sys.path[0] when run as a script
    machine,
    require,
)

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import fingerprint as fp

RESULTS = Path(__file__).parent / "results"
FILE_BYTES = 256 << 20  # shards of 256 MiB, as checkpoints come in several files


def _write_shards(folder: Path, total: int) -> None:
    chunk = os.urandom(1 << 20)
    for i in range(max(1, total // FILE_BYTES)):
        with open(folder / f"model-{i:05d}.safetensors", "wb") as f:
            for _ in range(FILE_BYTES >> 20):
                f.write(chunk)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    require()  # the standard library and this package only
    total = int(args.gib * (1 << 30))
    with tempfile.TemporaryDirectory(prefix="fingerprint-") as tmp:
        local = Path(tmp) / "local"
        local.mkdir()
        _write_shards(local, total)
        nbytes = sum(p.stat().st_size for p in local.iterdir())
        first = _timed(lambda: fp.weight_hashes(local))
        restart = _timed(lambda: fp.weight_hashes(local))
        # A hub snapshot: the same files as blobs named by their hashes.
        blobs = Path(tmp) / "blobs"
        snap = Path(tmp) / "snapshots" / "rev"
        blobs.mkdir()
        snap.mkdir(parents=True)
        for name, value in fp.weight_hashes(local).items():
            blob = blobs / value.split(":", 1)[1]
            os.replace(local / name, blob)
            os.symlink(blob, snap / name)
        hub = _timed(lambda: fp.weight_hashes(snap))
    rate = nbytes / first
    result = {
        "machine": machine(),
        "load": os.getloadavg(),
        "bytes": nbytes,
        "first_start_s": round(first, 3),
        "restart_s": round(restart, 4),
        "hub_snapshot_s": round(hub, 4),
        "hash_gb_per_s": round(rate / 1e9, 3),
        "first_start_extrapolated_s": {
            f"{gb} GB": round(gb * 1e9 / rate, 1) for gb in (1, 10, 100)
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fingerprint_cost.json").write_text(json.dumps(result, indent=1))
    rows = "\n".join(
        f"| {k} | {v} s |" for k, v in result["first_start_extrapolated_s"].items()
    )
    (args.out / "fingerprint_cost.md").write_text(
        f"""# Model fingerprint: cost at start

Machine: {result["machine"]}; load average {result["load"]}.
Measured over {nbytes / 1e9:.2f} GB of weight files (256 MiB shards, in the
page cache, as right after vLLM loaded them), one core, SHA-256:

| case | time |
| --- | --- |
| first start (every file hashed, the hashes cached) | {first:.2f} s \
({rate / 1e9:.2f} GB/s) |
| restart (cached hashes; size and modification time checked) | {restart * 1e3:.1f} ms |
| Hugging Face hub snapshot (blob names are the hashes) | {hub * 1e3:.1f} ms |

First start, extrapolated from the measured rate (files not in the page
cache are read from disk once more: add the disk's read time):

| weights | first start |
| --- | --- |
{rows}

Each instance of a fleet pays the first start once per checkpoint folder
(the cache is written beside the files, or under ~/.cache/vllm when
the folder is read-only); checkpoints downloaded from the hub cost nothing.
"""
    )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
