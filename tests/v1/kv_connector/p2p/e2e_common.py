"""What the P2P end-to-end modules share: server arguments, prompts, and the
checks that read a server's metrics.

Each module starts its own server set (module fixtures), so at most one set
runs at a time: on a 2-core machine two sets at once starve the P2P threads.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

from vllm_disagg.testing.p2p import (
    P2pInstance,
    disaggregated_completion,
    free_kv_port,
    kv_transfer_config,
)
from vllm_disagg.testing.server import get_free_port

BLOCK_SIZE = 32
MAX_BATCHED = 256
COMMON_ARGS = [
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "16",
    "--seed",
    "0",
    "--dtype",
    "float32",
    "--block-size",
    str(BLOCK_SIZE),
    "--max-num-batched-tokens",
    str(MAX_BATCHED),
    # No torch.compile: a compile of a new shape at run time holds the worker's
    # GIL for tens of seconds on these 2-core machines and starves the P2P threads.
    "--enforce-eager",
]
# Shorter than a block, one block, three blocks + 5, longer than one chunk.
PROMPT_LENGTHS = (1, BLOCK_SIZE, 3 * BLOCK_SIZE + 5, MAX_BATCHED + 2 * BLOCK_SIZE + 7)
MAX_TOKENS = 12
# Generous: the first transfer of a pair sets up its channel, and CI machines
# are busy starting servers; a load that times out is still right (recomputed)
# but fails the "came over the connector" checks.
LOAD_TIMEOUT_S = 20.0


def token_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(length)]


_rng = random.Random(20261122)
LENGTH_PROMPTS = [token_prompt(_rng, n) for n in PROMPT_LENGTHS]
# Many requests in flight: shared prefixes too, so prefix-cache hits happen on both
# sides.
_shared = token_prompt(_rng, 2 * BLOCK_SIZE)
MANY_PROMPTS = [
    (_shared if i % 3 == 0 else []) + token_prompt(_rng, _rng.randint(5, 150))
    for i in range(32)
]


def ids(response: dict) -> list[int]:
    return list(response["choices"][0]["token_ids"])


def key(prompt: list[int]) -> tuple[int, ...]:
    return tuple(prompt)


def colocated_reference(instance: P2pInstance, prompts: list[list[int]]) -> dict:
    """Greedy outputs of ``instance`` asked with no peers named (the connector
    then does nothing: a plain `vllm serve` run), by ``key(prompt)``."""
    with ThreadPoolExecutor(8) as pool:
        outs = list(
            pool.map(
                lambda p: ids(
                    instance.server.complete(
                        p, max_tokens=MAX_TOKENS, temperature=0.0, return_token_ids=True
                    )
                ),
                prompts,
            )
        )
    return {key(p): o for p, o in zip(prompts, outs)}


def start_instance(
    start_server, model, name, role, *, routers=(), **extra
) -> P2pInstance:
    """Start (without waiting) one instance of the tiny model with the
    connector in ``role``; it registers with ``routers`` if any."""
    port, http_port = free_kv_port(), get_free_port()
    if routers:
        # Several routers, each "host:port", as one comma-separated proxy_ip.
        extra["proxy_ip"] = ",".join(f"127.0.0.1:{r.discovery_port}" for r in routers)
        extra["http_port"] = str(http_port)
    server = start_server(
        model,
        [*COMMON_ARGS, "--kv-transfer-config", kv_transfer_config(role, port, **extra)],
        name=name,
        wait=False,
        port=http_port,
    )
    return P2pInstance(server, port)


def wait_all(instances: dict[str, P2pInstance]) -> None:
    for inst in instances.values():
        inst.server.wait_ready()


def metric(inst: P2pInstance, name: str) -> float:
    values = inst.server.metrics(prefix=name)
    return sum(
        v
        for metric, labels in values.items()
        if metric in (name, f"{name}_total")
        for v in labels.values()
    )


def wait_metric(
    inst: P2pInstance, name: str, at_least: float, timeout_s: float = 15.0
) -> float:
    """``metric`` once it reaches ``at_least`` or ``timeout_s`` passed: stats
    reach the API server with the engine's periodic outputs."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(inst, name)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def check_lengths(
    prefill, decode, reference, *, prompts=None, via_params=False
) -> None:
    """Every prompt of ``LENGTH_PROMPTS`` (or ``prompts``) through the pair
    equals the colocated run."""
    for prompt in LENGTH_PROMPTS if prompts is None else prompts:
        out = disaggregated_completion(
            prefill,
            decode,
            prompt,
            max_tokens=MAX_TOKENS,
            via_params=via_params,
            return_token_ids=True,
        )
        assert ids(out) == reference[key(prompt)], f"prompt of {len(prompt)} tokens"
