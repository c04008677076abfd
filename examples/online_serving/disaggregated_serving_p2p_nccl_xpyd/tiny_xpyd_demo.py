"""The whole xPyD stack on one CPU machine, with the embedded tiny MoE model.

Starts the router, one prefill instance and one decode instance that itself
runs data parallel (DP=2: one `vllm serve` per rank, step sync between them).
Every instance registers with the router by itself (``proxy_ip`` /
``proxy_port`` in its ``--kv-transfer-config``). Then it sends completions
(one streamed) and a chat through the router, prints each answer next to a
colocated run of the same request, says whether they all match, and shuts
everything down.

    python examples/online_serving/disaggregated_serving_p2p_nccl_xpyd/tiny_xpyd_demo.py

The colocated run is the prefill instance answering requests that name no
peers (then it computes them locally, like any `vllm serve`), before any
disaggregated traffic, so no extra server is needed on a 2-core machine.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_disagg.testing import openai_client
from vllm_disagg.testing.p2p import free_kv_port, kv_transfer_config
from vllm_disagg.testing.router import RouterProcess
from vllm_disagg.testing.server import ServerStartupError, VllmServer, get_free_port
from vllm_disagg.testing.tiny_models import build_all

PROMPTS = [
    "The quick brown fox",
    "Data parallel engines step together",
    "Prefill instances compute the key value cache and decode instances",
    "Once upon a time there was a tiny model",
]
CHAT = [{"role": "user", "content": "Tell me about prefill and decode."}]
SERVER_ARGS = [
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "8",
    "--dtype",
    "float32",
    "--seed",
    "0",
    "--block-size",
    "32",
    "--enforce-eager",
]


def _instance(
    model: Path,
    role: str,
    router: RouterProcess,
    log_dir: Path,
    name: str,
    extra_args: list[str] = (),
    kv_port: int | None = None,
) -> VllmServer:
    port = get_free_port()
    config = kv_transfer_config(
        role,
        kv_port or free_kv_port(),
        proxy_ip="127.0.0.1",
        proxy_port=str(router.discovery_port),
        http_port=str(port),
    )
    return VllmServer(
        model,
        [*SERVER_ARGS, *extra_args, "--kv-transfer-config", config],
        log_path=log_dir / f"{name}.log",
        port=port,
    )


def _wait_with_progress(servers: dict[str, VllmServer], started: float) -> None:
    """wait_ready() every server while printing a progress line every 15 s."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(15):
            print(
                f"  ... still starting ({time.monotonic() - started:.0f}s)", flush=True
            )

    threading.Thread(target=report, daemon=True).start()
    try:
        for name, server in servers.items():
            server.wait_ready()
            print(
                f"  {name} ready at {server.url} ({time.monotonic() - started:.0f}s)",
                flush=True,
            )
    finally:
        done.set()


def _completion_text(body: dict) -> str:
    return body["choices"][0]["text"]


def _ask_all(target, max_tokens: int) -> list[tuple[str, str]]:
    """(label, answer) for every request of the demo, sent to ``target``."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(
            pool.map(
                lambda p: _completion_text(
                    openai_client.complete(
                        target, p, max_tokens=max_tokens, temperature=0.0
                    )
                ),
                PROMPTS,
            )
        )
    answers = [(f"completion {p!r}", t) for p, t in zip(PROMPTS, texts)]
    answers.append(
        (
            f"streamed {PROMPTS[0]!r}",
            openai_client.streamed_text(
                openai_client.stream_completion(
                    target, PROMPTS[0], max_tokens=max_tokens, temperature=0.0
                )
            ),
        )
    )
    chat = openai_client.chat(target, CHAT, max_tokens=max_tokens, temperature=0.0)
    answers.append(
        (f"chat {CHAT[0]['content']!r}", chat["choices"][0]["message"]["content"])
    )
    return answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default=".cache/models", help="where tiny models are built"
    )
    parser.add_argument(
        "--logs", default=".cache/demo-logs", help="server and router logs"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    model = build_all(args.models)["tiny-mixtral"]
    log_dir = Path(args.logs)
    started = time.monotonic()
    router = RouterProcess(log_path=log_dir / "router.log", model=str(model))
    print(f"starting the router (log: {router.log_path})", flush=True)
    router.start()
    print(
        f"  router at {router.url}, discovery on port {router.discovery_port}",
        flush=True,
    )

    rpc_port, d_kv_port = get_free_port(), free_kv_port()
    dp = [
        "--data-parallel-size",
        "2",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(rpc_port),
    ]
    servers = {
        "prefill": _instance(model, "kv_producer", router, log_dir, "prefill"),
        **{
            f"decode DP rank {rank}": _instance(
                model,
                "kv_consumer",
                router,
                log_dir,
                f"decode-rank{rank}",
                [*dp, "--data-parallel-rank", str(rank)],
                kv_port=d_kv_port,
            )
            for rank in (0, 1)
        },
    }
    print(
        f"starting 1 prefill + 1 decode (DP=2) instance of {model.name} on CPU "
        f"(logs: {log_dir}/); this takes a few minutes on 2 cores",
        flush=True,
    )
    try:
        for server in servers.values():
            server.launch()
        _wait_with_progress(servers, started)
        router.wait_for_instances(
            lambda found: len(found) >= 3, timeout_s=30, what="all three registrations"
        )
        for inst in router.instances():
            print(
                f"  registered: {inst['role']:7} dp_rank {inst['dp_rank']} "
                f"{inst['http_addr']} (KV at {inst['kv_addr']})"
            )

        print(
            "\ncolocated run (the prefill instance, requests naming no peers) ...",
            flush=True,
        )
        colocated = _ask_all(servers["prefill"], args.max_tokens)
        print("disaggregated run through the router ...", flush=True)
        print(
            "(random weights: the text is noise by design; what counts is that both "
            "runs agree)"
        )
        routed = _ask_all(router, args.max_tokens)

        matches = 0
        for (label, expected), (_, got) in zip(colocated, routed):
            same = got == expected
            matches += same
            print(
                f"\n{label}\n  router:    {got!r}\n  colocated: {expected!r}\n  "
                f"{'same' if same else 'DIFFERENT'}"
            )
        received = sum(
            sum(
                servers[f"decode DP rank {rank}"]
                .metrics("vllm:p2p_bytes_received")
                .get(name, {})
                .values()
            )
            for rank in (0, 1)
            for name in ("vllm:p2p_bytes_received", "vllm:p2p_bytes_received_total")
        )
        print(
            f"\n{matches} of {len(routed)} answers through the router match the "
            "colocated run" + ("" if matches == len(routed) else " (MISMATCH)")
        )
        print(
            f"the decode ranks received {received / 1024:.0f} KiB of KV from the "
            "prefill"
        )
        return 0 if matches == len(routed) else 1
    except (ServerStartupError, TimeoutError) as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        print("\nshutting down ...", flush=True)
        for server in servers.values():
            server.stop()
        router.stop()
        print(f"all stopped ({time.monotonic() - started:.0f}s in all)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
