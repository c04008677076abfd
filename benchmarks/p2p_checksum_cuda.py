"""What a per-block KV checksum would cost on a CUDA worker (nccl), measured.

``kv_checksum`` hashes KV in host memory only (``checksum.py``); with the nccl
transport the KV never leaves the GPU. This measures the two ways it could
run there, per layer message (blocks of one layer, as the engine sends them):

* **a kernel**: per-block checksums computed on the GPU by PyTorch ops over
  the layer's blocks, ``sum`` (one pass: the int64 sum of each block's words)
  and ``weighted`` (each word times an odd per-position constant, then
  summed: catches swapped words too; unfused, so a temporary as large as the
  message is written and read back). A fused kernel (Triton, CUDA) would read
  the message once; launch overhead is per layer either way;
* **a host copy**: the layer copied to pinned host memory, then hashed there
  by ``checksum.py`` (``crc32c``, what ``kv_checksum`` offers, one call per
  block, one thread).

Next to them: a device-to-device copy of the same bytes (HBM, the floor of
moving them at all) for scale. And the host side alone: ``crc32c`` and
``xxh3_64`` per 32 KiB block in 1, 2, 4 and 8 threads at once (does the
hashing scale with cores, i.e. release the GIL?). Writes
benchmarks/results/p2p_checksum_cuda.{json,md} (well under a minute on one GPU;
``--out DIR``: elsewhere).

    python3 benchmarks/p2p_checksum_cuda.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch
from _deps import require  # benchmarks/_deps.py: sys.path[0] when run as a script
from common import report

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.checksum import (
    ChecksumUnavailable,
    make_checksum,
)

KIB, MIB = 1 << 10, 1 << 20
# (label, blocks, page bytes): one layer message
MESSAGES = (
    ("32 x 32 KiB (1 MiB)", 32, 32 * KIB),
    ("128 x 32 KiB (4 MiB)", 128, 32 * KIB),
    ("512 x 64 KiB (32 MiB)", 512, 64 * KIB),
)
THREADS = (1, 2, 4, 8)
ALGORITHM = "crc32c"  # the host hash of a layer message
THREADED = ("crc32c", "xxh3_64")  # the thread scaling, each when installed


def _gpu_ms(fn, iters: int) -> float:
    """Mean ms of ``fn`` on the current stream (CUDA events), after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _host_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def _message(blocks: int, page: int, iters: int, checksum) -> dict:
    """Every timing of one layer message of ``blocks`` blocks of ``page`` bytes."""
    # every other block of a cache twice as large, gathered as the sender does
    cache = torch.randint(
        -(2**62), 2**62, (2 * blocks, page // 8), dtype=torch.int64, device="cuda"
    )
    layer = cache.index_select(0, torch.arange(0, 2 * blocks, 2, device="cuda"))
    weights = torch.arange(1, page // 4 + 1, 2, dtype=torch.int64, device="cuda")
    copy_dst = torch.empty_like(layer)
    host = torch.empty(blocks * page, dtype=torch.uint8, pin_memory=True)
    host_view = host.view(torch.int64).view(blocks, page // 8)
    host_view.copy_(layer)

    def d2h() -> None:
        host_view.copy_(layer, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    return {
        "bytes": blocks * page,
        "d2d_copy_ms": _gpu_ms(lambda: copy_dst.copy_(layer), iters),
        "kernel_sum_ms": _gpu_ms(lambda: layer.sum(dim=1), iters),
        "kernel_weighted_ms": _gpu_ms(lambda: (layer * weights).sum(dim=1), iters),
        "d2h_copy_ms": _host_ms(d2h, iters),
        "host_hash_ms": _host_ms(lambda: checksum.digests([host], page), iters),
    }


def per_message(iters: int) -> dict:
    checksum = make_checksum(ALGORITHM)
    return {
        label: _message(blocks, page, iters, checksum)
        for label, blocks, page in MESSAGES
    }


def _threads_gbps(n: int, seconds: float, checksum) -> float:
    bufs = [torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8) for _ in range(n)]
    done = [0] * n
    stop = threading.Event()

    def work(i: int) -> None:
        while not stop.is_set():
            checksum.digests([bufs[i]], 32 * KIB)
            done[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(done) * 64 * MIB / (time.perf_counter() - start) / 1e9


def host_threads(seconds: float) -> dict:
    """Aggregate GB/s per 32 KiB block, n threads, own buffers, per algorithm."""
    out = {}
    for name in THREADED:
        try:
            checksum = make_checksum(name)
        except ChecksumUnavailable:
            continue
        out[name] = {n: _threads_gbps(n, seconds, checksum) for n in THREADS}
    return out


def markdown(result: dict, args) -> list[str]:
    rows = []
    for label, m in result["messages"].items():
        gb = m["bytes"] / 1e9
        rows.append(
            [
                label,
                *(
                    f"{m[k] * 1000:.0f} µs ({gb / (m[k] / 1000):.0f} GB/s)"
                    for k in (
                        "d2d_copy_ms",
                        "kernel_sum_ms",
                        "kernel_weighted_ms",
                        "d2h_copy_ms",
                        "host_hash_ms",
                    )
                ),
            ]
        )
    return [
        "# A per-block KV checksum on a CUDA worker: a kernel or a host copy",
        "",
        report.generated(
            "p2p_checksum_cuda.py",
            f"GPU: {result['gpu']}. Load average (1 min) before and after: "
            f"{args.load_average[0]:.1f}, {args.load_average[1]:.1f}.",
        ),
        "",
        "Per layer message (the blocks of one layer, gathered; int64 words). GPU "
        f"times: mean of {args.iters} runs by CUDA events; host times: median of "
        f"{args.iters}. `sum`: one reduction per block; `weighted`: words times odd "
        "per-position constants, then summed (unfused: a temporary as large as the "
        f"message); host hash: `{ALGORITHM}` per block over the pinned copy, one "
        "thread.",
        "",
        *report.table(
            [
                "message",
                "D2D copy",
                "kernel: sum",
                "kernel: weighted",
                "D2H copy (pinned)",
                "host hash",
            ],
            rows,
        ),
        "",
        "Host only: per 32 KiB block, n threads at once, each on a 64 MiB buffer of "
        f"its own, aggregate GB/s ({os.cpu_count()} CPUs):",
        "",
        *report.table(
            ["algorithm", *(f"{n} thread{'s' if n > 1 else ''}" for n in THREADS)],
            [
                [name, *(f"{by_n[n]:.1f}" for n in THREADS)]
                for name, by_n in result["host_threads_gbps"].items()
            ],
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--thread-seconds", type=float, default=2.0)
    report.add_out_argument(parser)
    args = parser.parse_args()
    require()  # torch and this package only
    if not torch.cuda.is_available():
        print("p2p_checksum_cuda.py: no CUDA device", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "messages": per_message(args.iters),
        "host_threads_gbps": host_threads(args.thread_seconds),
    }
    args.load_average = [load_before, os.getloadavg()[0]]
    result["args"] = {k: v for k, v in vars(args).items() if k != "out"}
    stem = (args.out or report.RESULTS) / "p2p_checksum_cuda"
    report.write(stem, result, markdown(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
