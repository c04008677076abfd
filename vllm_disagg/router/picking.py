"""Which instances a request goes to: a decode, then a prefill whose KV it can take.

Candidates are the registry's healthy instances of a side serving the
request's model; a prefill must have the decode's model fingerprint (an
unknown one pairs with any), and a decode is only picked when some healthy
prefill could serve it. Among the candidates the side's policy
(``policy.py``) chooses. Apart from the proxy, which runs the hand-off, so
the migrator and the fleet-scale benchmark pick exactly as requests do.
"""

from __future__ import annotations

from typing import Any, Protocol

from vllm_disagg.router.policy import Policies
from vllm_disagg.router.registry import Instance, InstanceRegistry
from vllm_disagg.wire.discovery import Role


class Request(Protocol):
    """What picking reads of a request (``exchange.Exchange``)."""

    @property
    def model(self) -> str | None: ...

    @property
    def body(self) -> dict[str, Any]: ...


class Picker:
    def __init__(self, registry: InstanceRegistry, policies: Policies) -> None:
        self.registry = registry
        self.policies = policies

    def pick(
        self,
        side: Role,
        ex: Request,
        exclude: set[str] = frozenset(),
        model: str | None = None,
        partner: Instance | None = None,
    ) -> Instance | None:
        """An instance of ``side`` serving ``model`` (default: the request's)
        whose KV is ``partner``'s (the same model fingerprint)."""
        model = ex.model if model is None else model
        candidates = self.registry.healthy(side, model)
        fingerprint = "" if partner is None else partner.fingerprint
        if exclude or fingerprint:
            # compatible(i, partner) inlined: a call per candidate per request
            # was a tenth of selection at 1,000 instances.
            candidates = [
                i
                for i in candidates
                if i.instance_id not in exclude
                and (
                    not fingerprint or not i.fingerprint or i.fingerprint == fingerprint
                )
            ]
        if not candidates:
            return None
        policy = self.policies.prefill if side is Role.PREFILL else self.policies.decode
        return policy.select(candidates, ex.body)

    def pick_paired_decode(
        self, ex: Request, exclude: set[str] = frozenset()
    ) -> Instance | None:
        """A decode that some healthy prefill can serve: the same model
        fingerprint. With no healthy prefill at all, any decode (the request
        goes on to the no-prefill handling). None of ``exclude``."""
        prefills = self.registry.healthy(Role.PREFILL, ex.model)
        if not prefills:
            return self.pick(Role.DECODE, ex, exclude)
        fingerprints = {p.fingerprint for p in prefills}
        candidates = [
            d
            for d in self.registry.healthy(Role.DECODE, ex.model)
            if (
                not d.fingerprint or "" in fingerprints or d.fingerprint in fingerprints
            )
            and d.instance_id not in exclude
        ]
        if not candidates:
            return None
        return self.policies.decode.select(candidates, ex.body)

    def no_decode_reason(self, ex: Request) -> str:
        if self.registry.healthy(Role.DECODE, ex.model):
            return (
                "no prefill and decode instance of this model can form a pair: "
                "their model fingerprints differ (other weights, config, "
                "tokenizer, dtype or layout; see /instances)"
            )
        return "no healthy decode instance is registered"
