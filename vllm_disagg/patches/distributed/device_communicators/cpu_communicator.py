"""Patch: variable-size collectives for ``CpuCommunicator``.

Upstream: ``vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator``
inherits ``all_gatherv`` / ``reduce_scatterv`` from ``DeviceCommunicatorBase``,
where they raise ``NotImplementedError``. The MoE all2all manager used on CPU
(``AgRsAll2AllManager``) needs both as soon as data parallelism is on.

Gloo has neither uneven all-gather nor reduce-scatter, so:

* ``all_gatherv``: pad every rank's slice to the largest size, all-gather the
  padded tensors, then cut out each rank's real rows.
* ``reduce_scatterv``: all-reduce the whole input, keep this rank's rows.

Both move ``dim`` to the front first and back afterwards, so any dim works.
The extra traffic (padding, a full all-reduce) is irrelevant at CPU scale.

On CPU the MoE layer is traced by ``torch.compile`` (it is not hidden behind
the ``moe_forward`` custom op as on GPUs), and the per-rank sizes are
data-dependent there. So the collectives are registered as opaque custom ops
(``torch.ops.vllm_disagg.cpu_all_gatherv`` / ``cpu_reduce_scatterv``) whose
fake implementations give every gathered tensor the same symbolic length,
``sum(sizes)``; traced slicing would give each its own unknown length.
"""

from __future__ import annotations

import torch
from torch.library import Library
from vllm.distributed import parallel_state
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.utils.torch_utils import direct_register_custom_op

_lib = Library("vllm_disagg", "FRAGMENT")  # noqa: TID251


def _check_sizes(
    communicator: CpuCommunicator, local_size: int, sizes: list[int]
) -> None:
    """Validate per-rank sizes; called eagerly, never while tracing."""
    rank = communicator.rank_in_group
    if sizes[rank] != local_size:
        raise ValueError(
            f"rank {rank} holds {local_size} rows along the gather dim, "
            f"but sizes says {sizes[rank]}"
        )


def _all_gatherv_one(
    communicator: CpuCommunicator, tensor: torch.Tensor, dim: int, sizes: list[int]
) -> torch.Tensor:
    front = tensor.movedim(dim, 0)
    _check_sizes(communicator, front.shape[0], sizes)
    max_size = max(sizes)
    padded = front.new_zeros((max_size,) + tuple(front.shape[1:]))
    padded[: front.shape[0]].copy_(front)
    gathered = front.new_empty((max_size * len(sizes),) + tuple(front.shape[1:]))
    communicator.dist_module.all_gather_into_tensor(
        gathered, padded, group=communicator.device_group
    )
    pieces = [
        gathered[rank * max_size : rank * max_size + size]
        for rank, size in enumerate(sizes)
    ]
    return torch.cat(pieces, dim=0).movedim(0, dim).contiguous()


def _communicator(group_name: str) -> CpuCommunicator:
    group = parallel_state._groups[group_name]()
    assert group is not None, f"process group {group_name!r} is gone"
    return group.device_communicator


def _cpu_all_gatherv(
    input_: torch.Tensor, dim: int, sizes: list[int], group_name: str
) -> torch.Tensor:
    return _all_gatherv_one(_communicator(group_name), input_, dim, sizes)


def _cpu_all_gatherv_fake(
    input_: torch.Tensor, dim: int, sizes: list[int], group_name: str
) -> torch.Tensor:
    shape = list(input_.shape)
    shape[dim] = sum(sizes)
    return input_.new_empty(shape)


def _cpu_reduce_scatterv(
    input_: torch.Tensor, dim: int, sizes: list[int], rank: int, group_name: str
) -> torch.Tensor:
    return _reduce_scatterv_one(_communicator(group_name), input_, dim, sizes)


def _cpu_reduce_scatterv_fake(
    input_: torch.Tensor, dim: int, sizes: list[int], rank: int, group_name: str
) -> torch.Tensor:
    shape = list(input_.shape)
    shape[dim] = sizes[rank]
    return input_.new_empty(shape)


def _reduce_scatterv_one(
    communicator: CpuCommunicator, input_: torch.Tensor, dim: int, sizes: list[int]
) -> torch.Tensor:
    front = input_.movedim(dim, 0)
    if sum(sizes) != front.shape[0]:
        raise ValueError(f"sizes {sizes} do not sum to the {front.shape[0]} rows")
    # all_reduce works in place: reduce a copy, not the caller's tensor.
    reduced = front.clone(memory_format=torch.contiguous_format)
    communicator.dist_module.all_reduce(reduced, group=communicator.device_group)
    start = sum(sizes[: communicator.rank_in_group])
    mine = reduced[start : start + sizes[communicator.rank_in_group]]
    return mine.movedim(0, dim).contiguous()


direct_register_custom_op(
    "cpu_all_gatherv",
    _cpu_all_gatherv,
    fake_impl=_cpu_all_gatherv_fake,
    target_lib=_lib,
)
direct_register_custom_op(
    "cpu_reduce_scatterv",
    _cpu_reduce_scatterv,
    fake_impl=_cpu_reduce_scatterv_fake,
    target_lib=_lib,
)


def all_gatherv(
    self: CpuCommunicator,
    input_: torch.Tensor | list[torch.Tensor],
    dim: int = 0,
    sizes: list[int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """All-gather tensors whose size along ``dim`` differs per rank."""
    if self.world_size == 1:
        return input_
    tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
    outputs = []
    for tensor in tensors:
        tensor_dim = dim + tensor.dim() if dim < 0 else dim
        tensor_sizes = (
            [tensor.shape[tensor_dim]] * self.world_size if sizes is None else sizes
        )
        if len(tensor_sizes) != self.world_size:
            raise ValueError(f"{len(tensor_sizes)} sizes for {self.world_size} ranks")
        outputs.append(
            torch.ops.vllm_disagg.cpu_all_gatherv(
                tensor, tensor_dim, list(tensor_sizes), self.unique_name
            )
        )
    return outputs[0] if isinstance(input_, torch.Tensor) else outputs


def reduce_scatterv(
    self: CpuCommunicator,
    input_: torch.Tensor,
    dim: int = -1,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    """Sum across ranks, then keep this rank's (possibly uneven) slice."""
    if self.world_size == 1:
        return input_
    if dim < 0:
        dim += input_.dim()
    total = input_.shape[dim]
    if sizes is None:
        if total % self.world_size:
            raise ValueError(f"{total} rows do not split over {self.world_size} ranks")
        sizes = [total // self.world_size] * self.world_size
    elif len(sizes) != self.world_size:
        raise ValueError(f"{len(sizes)} sizes for {self.world_size} ranks")
    return torch.ops.vllm_disagg.cpu_reduce_scatterv(
        input_, dim, list(sizes), self.rank_in_group, self.unique_name
    )


def apply() -> None:
    CpuCommunicator.all_gatherv = all_gatherv
    CpuCommunicator.reduce_scatterv = reduce_scatterv


def is_applied() -> bool:
    return (
        CpuCommunicator.all_gatherv is all_gatherv
        and CpuCommunicator.reduce_scatterv is reduce_scatterv
    )
