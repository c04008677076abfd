"""cpu-seeded-requests: a seeded request on the CPU model runner.

Upstream's ``GPUModelRunner._bookkeeping_sync`` (inherited by
``CPUModelRunner``) rewinds the generator of every request whose sample is
discarded (a partial prefill chunk) with ``set_offset(get_offset() - 4)``;
a CPU generator raises there and the engine dies. The wrappers of
:mod:`vllm_disagg.patches.v1.worker.cpu_model_runner` are called here on a
stand-in runner, with upstream's real methods underneath where they can run
on one (the sampler is a fake that draws as upstream's ``random_sample``
does), and with a failing fake for the ``finally``. One ``e2e`` test serves the
tiny Llama with small chunks and sends a seeded request whose prompt spans
several of them.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_disagg import envs
from vllm_disagg.patches import PATCHES
from vllm_disagg.patches.v1.worker import cpu_model_runner as patch

BY_NAME = {p.name: p for p in PATCHES}
VOCAB = 64
MAX_LEN = 16


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def _draw(gen: torch.Generator) -> torch.Tensor:
    """One sample's worth of randomness, as upstream's random_sample draws it."""
    return torch.empty(VOCAB).exponential_(generator=gen)


class _FakeSampler:
    """Draws from each request's generator like upstream's random_sample and
    returns one token per request."""

    def __call__(self, logits, sampling_metadata):
        tokens = torch.zeros(logits.shape[0], 1, dtype=torch.int64)
        for i, gen in sampling_metadata.generators.items():
            tokens[i, 0] = int((logits[i] / _draw(gen)).argmax())
        return SimpleNamespace(sampled_token_ids=tokens, logprobs_tensors=None)


def _runner(
    generators: dict[int, torch.Generator], discard: list[bool]
) -> SimpleNamespace:
    """What upstream's _sample and _bookkeeping_sync read of a runner
    (vLLM 0.32.0, no async scheduling, no spec decode)."""
    num_reqs = len(discard)
    req_ids = [f"r{i}" for i in range(num_reqs)]
    input_batch = SimpleNamespace(
        num_reqs=num_reqs,
        generators=generators,
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        num_tokens_no_spec=np.full(num_reqs, 4, dtype=np.int64),
        token_ids_cpu=np.zeros((num_reqs, MAX_LEN), dtype=np.int64),
        is_token_ids=np.zeros((num_reqs, MAX_LEN), dtype=bool),
        vocab_size=VOCAB,
        update_async_output_token_ids=lambda: None,
    )
    # The sampling metadata holds the input batch's dict itself, as upstream's does.
    input_batch.sampling_metadata = SimpleNamespace(generators=generators)
    return SimpleNamespace(
        input_batch=input_batch,
        discard_request_mask=SimpleNamespace(np=np.array(discard + [False] * 3)),
        sampler=_FakeSampler(),
        use_async_scheduling=False,
        max_model_len=MAX_LEN,
        requests={r: SimpleNamespace(output_token_ids=[]) for r in req_ids},
        _to_list=lambda t: t.tolist(),
        _get_prompt_logprobs_dict=lambda hidden_states, num_scheduled_tokens: {},
    )


def _step(runner, *, sample=patch._sample, bookkeeping=patch._bookkeeping_sync):
    """One step of sample_tokens: _sample, then _bookkeeping_sync."""
    num_reqs = runner.input_batch.num_reqs
    logits = torch.randn(num_reqs, VOCAB, generator=_generator(99))
    sampler_output = sample(runner, logits, None)
    scheduler_output = SimpleNamespace(num_scheduled_tokens={})
    hidden_states = torch.zeros(num_reqs, 4)
    return bookkeeping(
        runner, scheduler_output, sampler_output, logits, hidden_states, 0
    )


def test_upstream_rewind_raises_for_a_cpu_generator():
    """The bug (and the drop-when check): upstream alone kills the step."""
    runner = _runner({0: _generator(7)}, [True])
    with pytest.raises(RuntimeError, match="does not use offset"):
        _step(
            runner,
            sample=GPUModelRunner._sample,
            bookkeeping=GPUModelRunner._bookkeeping_sync,
        )


def test_discarded_sample_does_not_consume_the_random_stream():
    gen = _generator(7)
    runner = _runner({0: gen}, [True])
    before = gen.get_state()

    valid_sampled_token_ids = _step(runner)[3]  # (a) no RuntimeError

    assert valid_sampled_token_ids == [[]]  # upstream still discarded the token
    assert torch.equal(gen.get_state(), before)  # (b) state exactly as before
    assert runner.input_batch.generators == {0: gen}
    # Draw, discard, draw again == draw once on a fresh generator of the same seed.
    assert torch.equal(_draw(gen), _draw(_generator(7)))


def test_kept_samples_advance_and_other_requests_are_untouched():
    # Request 1 has no seed (no generator).
    discarded, kept = _generator(7), _generator(8)
    generators = {0: discarded, 2: kept}
    runner = _runner(generators, [True, False, False])

    valid_sampled_token_ids = _step(runner)[3]

    assert valid_sampled_token_ids[0] == []
    assert len(valid_sampled_token_ids[1]) == len(valid_sampled_token_ids[2]) == 1
    assert torch.equal(discarded.get_state(), _generator(7).get_state())
    # (c) the kept request's stream advanced by exactly one sample.
    reference = _generator(8)
    _draw(reference)
    assert torch.equal(kept.get_state(), reference.get_state())
    assert runner.input_batch.generators is generators
    assert generators == {0: discarded, 2: kept}


def test_a_chunked_prompt_samples_as_an_unchunked_one():
    """Three discarded chunks, then the last one: the token is the one a
    single-chunk prefill samples (the property a seed promises)."""
    chunked = _generator(7)
    for _ in range(3):
        _step(_runner({0: chunked}, [True]))
    tokens = _step(_runner({0: chunked}, [False]))[3]
    assert tokens == _step(_runner({0: _generator(7)}, [False]))[3]


def test_generators_dict_is_put_back_when_upstream_raises(monkeypatch):
    gen, other = _generator(7), _generator(8)
    generators = {0: gen, 1: other}
    runner = _runner(generators, [True, False])
    seen = {}

    def failing_bookkeeping(self, *args, **kwargs):
        seen["generators"] = dict(self.input_batch.generators)
        raise ValueError("upstream failed")

    monkeypatch.setattr(patch, "_upstream_bookkeeping_sync", failing_bookkeeping)
    with pytest.raises(ValueError, match="upstream failed"):
        _step(runner)
    assert seen["generators"] == {1: other}  # upstream did not see the discarded one
    assert runner.input_batch.generators is generators  # (d)
    assert generators == {0: gen, 1: other}
    assert not hasattr(runner, patch._STATES_ATTR)


def test_generators_of_other_devices_are_left_to_upstream(monkeypatch):
    """Only CPU generators are hidden and restored; upstream's rewind still
    sees any other (a stand-in whose device is "cuda")."""
    cuda_like = SimpleNamespace(device=torch.device("cuda"))
    runner = _runner({0: cuda_like, 1: _generator(7)}, [True, True])
    assert patch.discarded_cpu_generators(runner) == {
        1: runner.input_batch.generators[1]
    }
    seen = {}

    def upstream_bookkeeping(self, *args, **kwargs):
        seen.update(self.input_batch.generators)

    monkeypatch.setattr(patch, "_upstream_sample", lambda self, *a, **k: None)
    monkeypatch.setattr(patch, "_upstream_bookkeeping_sync", upstream_bookkeeping)
    _step(runner)
    assert seen == {0: cuda_like}


def test_apply_is_idempotent_and_checked(monkeypatch):
    # Upstream's state (whether or not this process loaded the plugin).
    for name in ("_sample", "_bookkeeping_sync"):
        monkeypatch.setattr(CPUModelRunner, name, getattr(GPUModelRunner, name))
    assert not patch.is_applied()
    patch.apply()
    patch.apply()
    assert patch.is_applied()
    assert CPUModelRunner._sample is patch._sample
    assert CPUModelRunner._bookkeeping_sync is patch._bookkeeping_sync
    assert patch._upstream_bookkeeping_sync is GPUModelRunner._bookkeeping_sync
    monkeypatch.setattr(CPUModelRunner, "_sample", GPUModelRunner._sample)
    assert not patch.is_applied()


def test_registered_as_an_enabler_of_the_upstream_module():
    entry = BY_NAME["cpu-seeded-requests"]
    assert entry.kind == "enabler"
    assert entry.module == patch.__name__
    assert "_bookkeeping_sync" in entry.upstream and "_sample" in entry.upstream
    assert "CPU Generator does not use offset" in entry.why


def test_applied_by_the_plugin_even_with_features_off():
    """Upstream vLLM's general-plugin hook applies it in every process, and as an
    enabler it stays on with VLLM_DISAGG_DISABLE=1."""
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.v1.worker.cpu_model_runner import CPUModelRunner\n"
        "from vllm_disagg.patches.v1.worker import cpu_model_runner as patch\n"
        "from vllm_disagg.patches import verify_applied\n"
        "assert patch.is_applied()\n"
        "assert CPUModelRunner._bookkeeping_sync is patch._bookkeeping_sync\n"
        "assert verify_applied()['cpu-seeded-requests']\n"
        "print('OK')\n"
    )
    env = {**os.environ, envs.VLLM_DISAGG_DISABLE: "1"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "OK" in out.stdout


@pytest.mark.e2e
def test_seeded_chunked_prompt_on_a_real_server(tiny_models, start_server):
    """A seeded 200-token prompt in 64-token chunks: the server stays up,
    and the answer equals the one the same seed gives the same prompt from
    the prefix cache (one chunk, no discarded sample)."""
    args = [
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "16",
        "--seed",
        "0",
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-num-batched-tokens",
        "64",
        "--enforce-eager",
    ]
    server = start_server(tiny_models["tiny-llama"], args, name="cpu-seeded-requests")
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(200)]

    def seeded() -> list[int]:
        body = server.complete(
            prompt, max_tokens=12, temperature=1.0, seed=7, return_token_ids=True
        )
        return list(body["choices"][0]["token_ids"])

    chunked = seeded()  # 64 + 64 + 64 + 8: three discarded samples
    cached = seeded()  # 192 tokens from the prefix cache, then 8: none
    hits = sum(
        server.metrics(prefix="vllm:prefix_cache_hits_total")
        .get("vllm:prefix_cache_hits_total", {})
        .values()
    )  # in tokens
    assert server.proc.poll() is None, server.log_tail()
    assert hits >= 192, f"the second request should come from the prefix cache ({hits})"
    assert len(chunked) == 12 and chunked == cached
    assert "no generator state saved" not in server.log_text()
