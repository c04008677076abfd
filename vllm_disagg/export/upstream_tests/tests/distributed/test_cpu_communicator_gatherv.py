"""CpuCommunicator.all_gatherv / reduce_scatterv on a real 2-process gloo group."""

import multiprocessing as mp
import traceback
from types import SimpleNamespace

import pytest
import torch

from vllm.utils.network_utils import get_open_port

pytestmark = pytest.mark.cpu_test

WORLD_SIZE = 2
GROUP_NAME = "ep:gatherv-test"
# (dim, sizes): even and uneven, first/middle/last/negative dims, a zero size,
# and no sizes (even split).
CASES = [(0, [2, 2]), (0, [3, 5]), (1, [1, 4]), (-1, [2, 3]), (2, [0, 3]), (0, None)]


def _rank_tensor(rank: int, rows: int, dim: int) -> torch.Tensor:
    shape = [2, 3, 4]
    shape[dim] = rows
    numel = shape[0] * shape[1] * shape[2]
    return (torch.arange(numel, dtype=torch.float32) + 1000 * rank).reshape(shape)


def _worker(rank: int, port: int, results) -> None:
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

        group = torch.distributed.group.WORLD
        comm = CpuCommunicator(group, torch.device("cpu"), group, GROUP_NAME)
        # The custom ops find the communicator by group name, as in a real
        # vLLM process group.
        parallel_state._groups[GROUP_NAME] = lambda: SimpleNamespace(device_communicator=comm)
        for dim, sizes in CASES:
            pos = dim % 3
            rows = [2, 2] if sizes is None else sizes
            mine = _rank_tensor(rank, rows[rank], pos)
            want = torch.cat([_rank_tensor(r, rows[r], pos) for r in range(2)], pos)
            torch.testing.assert_close(comm.all_gatherv(mine, dim, sizes), want)
            both = comm.all_gatherv([mine, mine * 2], dim, sizes)
            torch.testing.assert_close(both[1], want * 2)

            total = sum(rows)
            full = _rank_tensor(rank, total, pos)
            before = full.clone()
            summed = sum(_rank_tensor(r, total, pos) for r in range(2))
            want = summed.narrow(pos, sum(rows[:rank]), rows[rank])
            torch.testing.assert_close(comm.reduce_scatterv(full, dim, sizes), want)
            torch.testing.assert_close(full, before)  # the input is left alone
        with pytest.raises(ValueError, match="sizes"):
            comm.all_gatherv(mine, 0, [1, 2, 3])
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_all_gatherv_and_reduce_scatterv_on_two_ranks():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = get_open_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, results)) for rank in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    outcome = {}
    try:
        for _ in range(WORLD_SIZE):
            rank, status = results.get(timeout=180)
            outcome[rank] = status
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert outcome == {0: "ok", 1: "ok"}, "\n".join(map(str, outcome.values()))


def test_fake_implementations_give_the_gathered_shapes():
    """torch.compile traces the ops through their fake implementations."""
    import vllm.distributed.device_communicators.cpu_communicator  # noqa: F401

    with torch._subclasses.FakeTensorMode():
        x = torch.empty(3, 5)
        gathered = torch.ops.vllm.cpu_all_gatherv(x, 0, [3, 4], GROUP_NAME)
        assert tuple(gathered.shape) == (7, 5)
        scattered = torch.ops.vllm.cpu_reduce_scatterv(x, 0, [1, 2], 1, GROUP_NAME)
        assert tuple(scattered.shape) == (2, 5)
