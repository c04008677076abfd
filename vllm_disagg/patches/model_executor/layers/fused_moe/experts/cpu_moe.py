"""Patch: the CPU MoE experts honour the expert map under expert parallelism.

Upstream: every ``apply`` of the experts classes in
``vllm.model_executor.layers.fused_moe.experts.cpu_moe`` receives
``expert_map`` (global expert id -> this rank's slot, -1 where another rank
holds the expert) and ignores it. With ``--enable-expert-parallel`` each rank
loads only its own experts, yet the kernels index the weights with the global
ids the router chose: the first forward pass reads past the weights and the
worker dies of a segmentation fault in ``cpu_fused_moe`` (its DP peers then
wait in the MoE combine until their collectives time out). The experts
classes still declare every parallel configuration supported.

Here each ``apply`` maps the routes first: a route to a local expert gets its
slot, a route to another rank's expert keeps a valid slot with weight 0, so
this rank adds exactly nothing for it; the combine step sums the ranks'
partial outputs as on GPUs. Where the kernel skips the weights
(``apply_router_weight_on_input``, top-1 routing), the rows routed elsewhere
are zeroed after the call.
"""

from __future__ import annotations

import functools
import inspect

import torch
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.experts import cpu_moe

_WRAPPED = "__honours_expert_map__"


def _local_expert_routes(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Global expert ids -> this rank's slots. Routes to experts of other
    ranks point at slot 0 with weight 0; also returns the rows none of whose
    routes is local (None when every route is)."""
    local = expert_map[topk_ids.long()]
    remote = local < 0
    if not bool(remote.any()):
        return local.to(topk_ids.dtype), topk_weights, None
    ids = local.clamp(min=0).to(topk_ids.dtype)
    return ids, topk_weights.masked_fill(remote, 0), remote.all(dim=-1)


def _honour_expert_map(apply_fn):
    """Wrap an experts ``apply`` that indexes its weights with global ids."""
    signature = inspect.signature(apply_fn)
    map_at = list(signature.parameters).index("expert_map")

    @functools.wraps(apply_fn)
    def apply_local(*args, **kwargs):
        # Without expert parallelism (no map): straight through, no binding.
        given = args[map_at] if len(args) > map_at else kwargs.get("expert_map")
        if given is None:
            return apply_fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        expert_map = arguments["expert_map"]
        ids, weights, remote_rows = _local_expert_routes(
            arguments["topk_ids"], arguments["topk_weights"], expert_map
        )
        arguments["topk_ids"], arguments["topk_weights"] = ids, weights
        arguments["expert_map"] = None
        result = apply_fn(*bound.args, **bound.kwargs)
        if remote_rows is not None and arguments.get("apply_router_weight_on_input"):
            arguments["output"][remote_rows] = 0
        return result

    return apply_local


def _experts_classes() -> list[type]:
    """The classes of the CPU experts module that define an ``apply``
    taking ``expert_map`` (subclasses inherit the wrapped one)."""
    return [
        cls
        for cls in vars(cpu_moe).values()
        if isinstance(cls, type)
        and issubclass(cls, mk.FusedMoEExperts)
        and cls.__module__ == cpu_moe.__name__
        and "apply" in vars(cls)
        and "expert_map" in inspect.signature(vars(cls)["apply"]).parameters
    ]


def apply() -> None:
    for cls in _experts_classes():
        if not getattr(cls.apply, _WRAPPED, False):
            wrapped = _honour_expert_map(cls.apply)
            setattr(wrapped, _WRAPPED, True)
            cls.apply = wrapped


def is_applied() -> bool:
    classes = _experts_classes()
    return bool(classes) and all(getattr(c.apply, _WRAPPED, False) for c in classes)
