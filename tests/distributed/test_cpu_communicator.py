"""CpuCommunicator.all_gatherv / reduce_scatterv against a real 2-process gloo group."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from types import SimpleNamespace

import pytest
import torch

from vllm_disagg.testing.server import get_free_port

WORLD_SIZE = 2
GROUP_NAME = "ep:unit-test"


def _rank_tensor(rank: int, rows: int, dim: int, shape=(3, 4)) -> torch.Tensor:
    """Rank-specific data with ``rows`` entries along ``dim`` of a 3-D tensor."""
    full_shape = list((2,) + shape)
    full_shape[dim] = rows
    numel = 1
    for s in full_shape:
        numel *= s
    return (torch.arange(numel, dtype=torch.float32) + 1000 * rank).reshape(full_shape)


def _cases():
    # (dim, sizes): even and uneven sizes, first/middle/last/negative dims, a zero size.
    return [(0, [2, 2]), (0, [3, 5]), (1, [1, 4]), (-1, [2, 3]), (2, [0, 3]), (0, None)]


def _worker(rank: int, port: int, results):
    try:
        torch.distributed.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD_SIZE,
        )
        from vllm.distributed import parallel_state
        from vllm.distributed.device_communicators.cpu_communicator import (
            CpuCommunicator,
        )

        from vllm_disagg.patches.distributed.device_communicators import (
            cpu_communicator,
        )

        cpu_communicator.apply()
        group = torch.distributed.group.WORLD
        comm = CpuCommunicator(
            group, torch.device("cpu"), group, unique_name=GROUP_NAME
        )
        parallel_state._groups[GROUP_NAME] = lambda: SimpleNamespace(
            device_communicator=comm
        )

        for dim, sizes in _cases():
            pos_dim = dim % 3
            rows = [2, 2] if sizes is None else sizes
            # all_gatherv of one tensor and of a list of tensors.
            mine = _rank_tensor(rank, rows[rank], pos_dim)
            expected = torch.cat(
                [_rank_tensor(r, rows[r], pos_dim) for r in range(2)], pos_dim
            )
            got = comm.all_gatherv(mine, dim=dim, sizes=sizes)
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            got_list = comm.all_gatherv([mine, mine * 2], dim=dim, sizes=sizes)
            assert isinstance(got_list, list) and len(got_list) == 2
            torch.testing.assert_close(got_list[0], expected, rtol=0, atol=0)
            torch.testing.assert_close(got_list[1], expected * 2, rtol=0, atol=0)

            # reduce_scatterv: every rank holds the full length; each keeps its slice of
            # the sum.
            total = sum(rows)
            full = _rank_tensor(rank, total, pos_dim)
            before = full.clone()
            got = comm.reduce_scatterv(full, dim=dim, sizes=sizes)
            summed = sum(_rank_tensor(r, total, pos_dim) for r in range(2))
            start = sum(rows[:rank])
            expected = summed.narrow(pos_dim, start, rows[rank])
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
            torch.testing.assert_close(full, before, rtol=0, atol=0)  # input untouched

        # bf16 and integer dtypes go through the same path.
        ids = torch.tensor([rank] * (rank + 1), dtype=torch.int64)
        assert comm.all_gatherv(ids, dim=0, sizes=[1, 2]).tolist() == [0, 1, 1]
        half = torch.ones(4, 2, dtype=torch.bfloat16) * (rank + 1)
        assert comm.reduce_scatterv(half, dim=0, sizes=[1, 3]).float().sum().item() == (
            3 * 2 * (1 if rank == 0 else 3)
        )

        # Bad sizes are reported, not silently mis-sliced.
        with pytest.raises(ValueError, match="sizes"):
            comm.all_gatherv(mine, dim=0, sizes=[1, 2, 3])
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_all_gatherv_and_reduce_scatterv_two_ranks():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = get_free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, port, results)) for r in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    outcome = {}
    try:
        for _ in range(WORLD_SIZE):
            rank, status = results.get(timeout=180)
            outcome[rank] = status
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert outcome == {0: "ok", 1: "ok"}, "\n".join(str(v) for v in outcome.values())


def test_single_rank_is_identity():
    from vllm_disagg.patches.distributed.device_communicators.cpu_communicator import (
        all_gatherv,
        reduce_scatterv,
    )

    comm = SimpleNamespace(world_size=1)
    t = torch.randn(3, 2)
    assert all_gatherv(comm, t) is t
    assert reduce_scatterv(comm, t) is t
