"""Drive a real vLLM ``Scheduler`` by hand, with a KV connector, in-process.

The equivalent of upstream's ``tests/v1/kv_connector/unit/utils.py`` (not
installed with vLLM): no model is loaded and no worker runs. A test builds a
:class:`SchedulerHarness`, adds :class:`~vllm.v1.request.Request` objects,
and calls :meth:`SchedulerHarness.step`, which schedules, fakes the model
runner's output (one sampled token for every request whose prompt is
complete, none for a partial prefill chunk) and hands back the worker side's
``KVConnectorOutput`` the test asks for (``finished_sending``,
``finished_recving``, ``invalid_block_ids``)::

    harness = SchedulerHarness(model_path, "kv_consumer")
    harness.add(harness.request("r1", tokens(40, seed=1), kv_transfer_params=...))
    out = harness.step()                       # r1 -> WAITING_FOR_REMOTE_KVS
    out = harness.step(finished_recving={"r1"})  # the "worker" loaded it

Only the scheduler-side connector exists here: the KV cache config names one
full-attention group of ``num_blocks`` blocks and no tensors.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_disagg import envs
from vllm_disagg.distributed.kv_transfer import register_connectors
from vllm_disagg.testing.server import fleet_router_token
from vllm_disagg.wire.grants import GRANT_KEY, make_grant
from vllm_disagg.wire.peers import PeerInfoError, parse_peer_info

CONNECTOR = "P2pNcclConnector"
SAMPLED_TOKEN = 7  # what the fake model runner "samples"; never an EOS here
MAX_MODEL_LEN = 1024


def tokens(n: int, seed: int) -> list[int]:
    """``n`` prompt token ids; different seeds give different first tokens,
    so unrelated prompts never share a prefix-cache block."""
    rng = random.Random(seed)
    return [10 + (seed * 37) % 400] + [rng.randrange(10, 500) for _ in range(n - 1)]


def write_model_config(outdir: str | Path) -> Path:
    """A model directory holding only the tiny Llama's ``config.json``: all a
    scheduler needs (no weights are loaded, no tokenizer is initialized)."""
    import json

    from vllm_disagg.testing.tiny_models import ARCHITECTURES, VOCAB_SIZE, _config

    target = Path(outdir) / "tiny-llama-config"
    target.mkdir(parents=True, exist_ok=True)
    config = _config("tiny-llama", VOCAB_SIZE, 1, 2).to_dict()
    config.pop("transformers_version", None)
    config["architectures"] = [ARCHITECTURES["tiny-llama"]]
    (target / "config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n"
    )
    return target


def make_vllm_config(
    model: str | Path,
    kv_role: str | None,
    *,
    block_size: int = 16,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    kv_port: int = 21001,
    kv_ip: str = "127.0.0.1",
    send_type: str = "PUT",
    kv_load_failure_policy: str = "recompute",
    enable_prefix_caching: bool = True,
    data_parallel_rank: int = 0,
) -> VllmConfig:
    """A VllmConfig for the scheduler only; ``kv_role=None``: no connector."""
    register_connectors()
    model_config = ModelConfig(
        model=str(model),
        tokenizer=str(model),
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        skip_tokenizer_init=True,
    )
    scheduler_config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=True,
        # One batch in flight: blocks are freed when the scheduler says so,
        # not deferred behind an overlapping step.
        async_scheduling=False,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    kv_transfer_config = None
    if kv_role is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_role=kv_role,
            kv_port=kv_port,
            kv_connector_extra_config={"kv_ip": kv_ip, "send_type": send_type},
            kv_load_failure_policy=kv_load_failure_policy,
        )
    parallel_config = ParallelConfig(
        data_parallel_size=max(1, data_parallel_rank + 1),
        data_parallel_rank=data_parallel_rank,
    )
    return VllmConfig(
        model_config=model_config,
        parallel_config=parallel_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )


@contextlib.contextmanager
def _env_default(name: str, value: str):
    had = name in os.environ
    os.environ.setdefault(name, value)
    try:
        yield
    finally:
        if not had:
            os.environ.pop(name, None)


def _with_grant(request_id: str, params: dict | None) -> dict | None:
    """``params`` plus a router's grant for the peers the request names, if any."""
    try:
        peer = parse_peer_info(request_id, params)
    except PeerInfoError:
        return params
    if peer is None or (params is not None and GRANT_KEY in params):
        return params
    grant = make_grant(
        fleet_router_token(), peer.prefill_addr, peer.decode_addr, peer.key
    )
    return {**(params or {}), GRANT_KEY: grant}


def make_scheduler(vllm_config: VllmConfig, num_blocks: int) -> Scheduler:
    block_size = vllm_config.cache_config.block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=1,
                    head_size=64,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=False,
    )


@dataclass
class Step:
    """One scheduler step: what was scheduled and what came out."""

    output: SchedulerOutput
    engine_outputs: list[EngineCoreOutput]

    @property
    def meta(self) -> Any:
        """The connector metadata the workers would get this step."""
        return self.output.kv_connector_metadata

    @property
    def scheduled(self) -> dict[str, int]:
        return dict(self.output.num_scheduled_tokens)

    def finished(self) -> dict[str, EngineCoreOutput]:
        return {
            o.request_id: o for o in self.engine_outputs if o.finish_reason is not None
        }


class SchedulerHarness:
    """A real Scheduler plus a fake model runner and worker-side connector."""

    def __init__(
        self,
        model: str | Path,
        kv_role: str | None,
        *,
        num_blocks: int = 64,
        **config: Any,
    ):
        self.vllm_config = make_vllm_config(model, kv_role, **config)
        self.block_size = self.vllm_config.cache_config.block_size
        # The connector reads the fleet's router token from the environment
        # when it is built: the test fleet's, unless the test set one.
        with _env_default(envs.VLLM_DISAGG_ROUTER_TOKEN, fleet_router_token().decode()):
            self.scheduler = make_scheduler(self.vllm_config, num_blocks)
        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(self.block_size, sha256)
        self.initial_free_blocks = self.free_blocks

    # --- state ---

    @property
    def connector(self):
        """The scheduler-side P2P connector (``P2pSchedulerConnector``)."""
        connector = self.scheduler.connector
        return None if connector is None else connector._scheduler

    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def block_ids(self, req_id: str) -> list[int]:
        """Blocks the KV cache manager holds for ``req_id`` (its only group)."""
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def holds_blocks(self, req_id: str) -> bool:
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        return any(
            req_id in manager.req_to_blocks and manager.req_to_blocks[req_id]
            for manager in managers
        )

    def req(self, req_id: str) -> Request:
        return self.scheduler.requests[req_id]

    # --- requests ---

    def request(
        self,
        request_id: str,
        prompt_token_ids: list[int] | None,
        *,
        max_tokens: int = 4,
        kv_transfer_params: dict | None = None,
        prompt_embeds: torch.Tensor | None = None,
        grant: bool = True,
        n: int = 1,
        **sampling: Any,
    ) -> Request:
        """A generation request; ``prompt_token_ids=None`` with
        ``prompt_embeds`` (``[num_tokens, hidden]``) for a prompt-embeds one.

        When the id or ``kv_transfer_params`` name valid peers, the request
        carries the grant a router would add (test fleet token), unless
        ``grant=False``."""
        if grant:
            kv_transfer_params = _with_grant(request_id, kv_transfer_params)
        sampling_params = SamplingParams(max_tokens=max_tokens, n=n, **sampling)
        if kv_transfer_params is not None:
            sampling_params.extra_args = {"kv_transfer_params": kv_transfer_params}
        return Request(
            request_id=request_id,
            prompt_token_ids=None
            if prompt_token_ids is None
            else list(prompt_token_ids),
            sampling_params=sampling_params,
            pooling_params=None,
            prompt_embeds=prompt_embeds,
            block_hasher=self._block_hasher,
        )

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)

    # --- stepping ---

    def step(
        self,
        *,
        finished_sending: set[str] | None = None,
        finished_recving: set[str] | None = None,
        invalid_block_ids: set[int] | None = None,
        sampled: dict[str, list[int]] | None = None,
        between: Callable[[SchedulerOutput], None] | None = None,
    ) -> Step:
        """schedule() -> fake model runner output -> update_from_output().

        Every scheduled request whose prompt is complete after this step
        samples ``SAMPLED_TOKEN`` (or ``sampled[req_id]``); a partial prefill
        chunk samples nothing, as the real runner discards it. The keyword
        arguments are the worker side's report for this step; ``between`` runs
        after schedule() and before update_from_output() (an abort arriving
        while the step runs).
        """
        output = self.scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        sampled_token_ids = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            if sampled is not None and req_id in sampled:
                sampled_token_ids.append(list(sampled[req_id]))
            elif request.num_computed_tokens >= request.num_tokens:
                sampled_token_ids.append([SAMPLED_TOKEN])
            else:
                sampled_token_ids.append([])
        kv_output = KVConnectorOutput(
            finished_sending=set(finished_sending) if finished_sending else None,
            finished_recving=set(finished_recving) if finished_recving else None,
            invalid_block_ids=set(invalid_block_ids or ()),
        )
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled_token_ids,
            kv_connector_output=kv_output,
        )
        if between is not None:
            between(output)
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        flat = [o for outs in engine_outputs.values() for o in outs.outputs]
        return Step(output, flat)

    def is_finished(self, req_id: str) -> bool:
        """Finished (freed, or finished with its free delayed)."""
        request = self.scheduler.requests.get(req_id)
        return request is None or request.is_finished()

    def run_until_finished(
        self, req_ids: set[str] | str, max_steps: int = 50
    ) -> list[Step]:
        """Step (no worker reports) until every id in ``req_ids`` finished."""
        pending = {req_ids} if isinstance(req_ids, str) else set(req_ids)
        steps = []
        for _ in range(max_steps):
            pending = {r for r in pending if not self.is_finished(r)}
            if not pending:
                return steps
            steps.append(self.step())
        raise AssertionError(f"{sorted(pending)} did not finish in {max_steps} steps")

    def is_waiting_for_remote(self, req_id: str) -> bool:
        return self.req(req_id).status == RequestStatus.WAITING_FOR_REMOTE_KVS
