"""Patch (enabler): seeded requests on the CPU model runner.

Upstream: ``vllm.v1.worker.cpu_model_runner.CPUModelRunner._sample`` and
``_bookkeeping_sync``, both inherited from
``vllm.v1.worker.gpu_model_runner.GPUModelRunner``. A request with a
per-request ``seed`` gets its own ``torch.Generator(device=self.device)``
(``_update_states``), kept in ``input_batch.generators`` (batch index ->
generator). The sampler draws from it for every scheduled request, also for
a partial prefill chunk, whose token is then discarded
(``discard_request_mask``, filled in ``_prepare_inputs``). So that a
discarded sample does not consume the request's random stream,
``_bookkeeping_sync`` rewinds the generator of every discarded request with
``gen.set_offset(gen.get_offset() - 4)``: Philox offsets, which only CUDA
generators have. A CPU generator raises ``RuntimeError: CPU Generator does
not use offset`` on both calls, the exception leaves the model runner and
the engine dies (``EngineDeadError``) at the first seeded request whose
prompt is longer than one chunk (``--max-num-batched-tokens``).

The patch gives ``CPUModelRunner`` the same semantics without offsets:

* ``_sample`` (runs after ``_prepare_inputs`` filled the mask, before
  ``_bookkeeping_sync``): before upstream samples, snapshot ``get_state()``
  of every CPU generator whose request is marked discarded.
* ``_bookkeeping_sync``: put those snapshots back with ``set_state()``
  (exact: whatever the step drew for a discarded request is undone), and run
  upstream with ``input_batch.generators`` replaced, for the call, by a dict
  without the CPU generators of discarded requests, so upstream's rewind
  loop never sees them; the original dict is put back in a ``finally``.
  Upstream reads ``input_batch.generators`` nowhere else in that method, and
  ``sampling_metadata.generators`` (the same dict object) is left alone.

Generators on other devices are untouched, so upstream's own rewind still
runs for them. Drop when upstream rewinds CPU generators itself (e.g. by
state snapshots, or by not drawing for discarded requests).
"""

from __future__ import annotations

import functools

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_disagg.logger import init_logger

logger = init_logger(__name__)

# Upstream's methods, as CPUModelRunner resolves them (GPUModelRunner's).
_upstream_sample = CPUModelRunner._sample
_upstream_bookkeeping_sync = CPUModelRunner._bookkeeping_sync

# Runner attribute holding {batch index: (generator, state)} from _sample to
# _bookkeeping_sync of the same step.
_STATES_ATTR = "_vllm_disagg_discarded_generator_states"


def discarded_cpu_generators(runner) -> dict[int, torch.Generator]:
    """The CPU generators of the requests whose sample this step discards."""
    generators = runner.input_batch.generators
    if not generators:
        return {}
    num_reqs = runner.input_batch.num_reqs
    discard = runner.discard_request_mask.np[:num_reqs]
    return {
        int(i): gen
        for i, gen in generators.items()
        if 0 <= int(i) < num_reqs and discard[int(i)] and gen.device.type == "cpu"
    }


@functools.wraps(_upstream_sample)
def _sample(self, *args, **kwargs):
    setattr(
        self,
        _STATES_ATTR,
        {
            i: (gen, gen.get_state())
            for i, gen in discarded_cpu_generators(self).items()
        },
    )
    return _upstream_sample(self, *args, **kwargs)


@functools.wraps(_upstream_bookkeeping_sync)
def _bookkeeping_sync(self, *args, **kwargs):
    states = self.__dict__.pop(_STATES_ATTR, None) or {}
    hidden = discarded_cpu_generators(self)
    if not hidden:
        return _upstream_bookkeeping_sync(self, *args, **kwargs)
    for i, gen in hidden.items():
        saved = states.get(i)
        if saved is not None and saved[0] is gen:
            gen.set_state(saved[1])
        else:
            logger.warning(
                "vllm_disagg: no generator state saved for discarded request "
                "index %d; its random stream stays advanced by this step",
                i,
            )
    batch = self.input_batch
    generators = batch.generators
    batch.generators = {i: gen for i, gen in generators.items() if int(i) not in hidden}
    try:
        return _upstream_bookkeeping_sync(self, *args, **kwargs)
    finally:
        batch.generators = generators


def apply() -> None:
    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync


def is_applied() -> bool:
    return (
        CPUModelRunner.__dict__.get("_sample") is _sample
        and CPUModelRunner.__dict__.get("_bookkeeping_sync") is _bookkeeping_sync
    )
