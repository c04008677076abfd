"""Serve the tiny MoE model with two data-parallel engines on CPU and query it.

Runs the ordinary `vllm serve` (this package loads as a vLLM plugin), sends a
few greedy completions concurrently, prints them, and stops the server.

    python examples/online_serving/data_parallel_tiny_moe.py [--dp 2] [--models DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_disagg.testing.server import ServerStartupError, VllmServer
from vllm_disagg.testing.tiny_models import build_all

PROMPTS = [
    "The quick brown fox",
    "Data parallel engines step together",
    "Prefill instances compute the key value cache",
    "Once upon a time there was a tiny model",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dp", type=int, default=2, help="--data-parallel-size (default 2)"
    )
    parser.add_argument(
        "--models", default=".cache/models", help="where tiny models are built"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    model = build_all(args.models)["tiny-mixtral"]
    log = Path(args.models).parent / "demo-server.log"
    print(
        f"starting vllm serve {model} --data-parallel-size {args.dp} (log: {log})",
        flush=True,
    )
    started = time.monotonic()
    server = VllmServer(
        model,
        [
            "--data-parallel-size",
            str(args.dp),
            "--max-model-len",
            "512",
            "--dtype",
            "float32",
        ],
        log_path=log,
    )
    try:
        with server:
            print(
                f"ready in {time.monotonic() - started:.0f}s at {server.url}",
                flush=True,
            )
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                bodies = list(
                    pool.map(
                        lambda p: server.complete(
                            p,
                            max_tokens=args.max_tokens,
                            temperature=0.0,
                            return_token_ids=True,
                        ),
                        PROMPTS,
                    )
                )
            for prompt, body in zip(PROMPTS, bodies):
                choice = body["choices"][0]
                print(
                    f"\nprompt: {prompt!r}\n  text: {choice['text']!r}\n  token ids: "
                    f"{choice['token_ids']}"
                )
    except ServerStartupError as exc:
        print(exc, file=sys.stderr)
        return 1
    print("\nserver stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
