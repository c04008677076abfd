"""Tests for the rewind of seeded generators whose sample is discarded
(GPUModelRunner._sample and _bookkeeping_sync, model runner V1).

A partial prefill chunk samples a token that is then discarded; the request's
generator must not lose that draw, or a seeded request would depend on how its
prompt was chunked. CPU generators have no Philox offset to rewind, so the
runner restores their state instead.

Both methods only use CPU-side state here, so they are exercised against a
lightweight stub for `self` instead of a full runner.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.v1.sample.ops.topk_topp_sampler import random_sample
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

pytestmark = pytest.mark.cpu_test

VOCAB = 32
MAX_LEN = 16


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


class _RandomSampler:
    """Samples every request with upstream's random_sample, one token each."""

    def __call__(self, logits, sampling_metadata):
        probs = logits.softmax(dim=-1)
        tokens = random_sample(probs, sampling_metadata.generators)
        return SimpleNamespace(
            sampled_token_ids=tokens.view(-1, 1), logprobs_tensors=None
        )


def _runner(generators: dict[int, torch.Generator], discard: list[bool]):
    num_reqs = len(discard)
    req_ids = [f"req{i}" for i in range(num_reqs)]
    input_batch = SimpleNamespace(
        num_reqs=num_reqs,
        generators=generators,
        sampling_metadata=SimpleNamespace(generators=generators),
        update_async_output_token_ids=lambda: None,
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        num_tokens_no_spec=np.full(num_reqs, 4, dtype=np.int64),
        token_ids_cpu=np.zeros((num_reqs, MAX_LEN), dtype=np.int64),
        is_token_ids=np.zeros((num_reqs, MAX_LEN), dtype=bool),
        vocab_size=VOCAB,
    )
    return SimpleNamespace(
        input_batch=input_batch,
        discard_request_mask=SimpleNamespace(np=np.array(discard + [False] * 4)),
        sampler=_RandomSampler(),
        use_async_scheduling=False,
        max_model_len=MAX_LEN,
        requests={req_id: SimpleNamespace(output_token_ids=[]) for req_id in req_ids},
        _to_list=lambda tensor: tensor.tolist(),
        _get_prompt_logprobs_dict=lambda hidden_states, num_scheduled_tokens: {},
    )


def _step(runner) -> list[list[int]]:
    """sample_tokens' sampling and bookkeeping; the valid sampled token ids."""
    num_reqs = runner.input_batch.num_reqs
    logits = torch.randn(num_reqs, VOCAB, generator=_generator(1234))
    sampler_output = GPUModelRunner._sample(runner, logits, None)
    outputs = GPUModelRunner._bookkeeping_sync(
        runner,
        SimpleNamespace(num_scheduled_tokens={}),
        sampler_output,
        logits,
        torch.zeros(num_reqs, 4),
        0,
    )
    return outputs[3]


def test_discarded_sample_restores_cpu_generator_state():
    generator = _generator(7)
    before = generator.get_state()

    assert _step(_runner({0: generator}, [True])) == [[]]

    assert torch.equal(generator.get_state(), before)


def test_kept_sample_advances_cpu_generator():
    discarded, kept = _generator(7), _generator(8)
    # The request at index 1 has no seed, so no generator of its own.
    valid = _step(_runner({0: discarded, 2: kept}, [True, False, False]))

    assert valid[0] == [] and len(valid[1]) == len(valid[2]) == 1
    assert torch.equal(discarded.get_state(), _generator(7).get_state())
    assert not torch.equal(kept.get_state(), _generator(8).get_state())


def test_chunked_prefill_samples_like_a_single_chunk():
    chunked = _generator(7)
    for _ in range(3):
        assert _step(_runner({0: chunked}, [True])) == [[]]

    assert _step(_runner({0: chunked}, [False])) == _step(
        _runner({0: _generator(7)}, [False])
    )
