"""What the router shows of its fleet: listing rows and /metrics gauges.

Read-only views of the registry's instances, apart from the membership,
selection and health rules that change them (``registry.py``). Each view
first drops the instances whose heartbeats stopped, so nothing listed is
already gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_disagg.router.circuit_breaker import BreakerState
from vllm_disagg.router.instance import Instance, compatible
from vllm_disagg.router.instance_index import InstanceIndex
from vllm_disagg.wire.discovery import Role


class RegistryViews:
    """Mixed into :class:`~vllm_disagg.router.registry.InstanceRegistry`."""

    _instances: dict[str, Instance]
    _index: InstanceIndex
    clock: Callable[[], float]

    if TYPE_CHECKING:  # the registry's, which these views read

        def expire(self) -> list[Instance]: ...

        def has_partner(self, instance: Instance) -> bool: ...

        def breaker_state(
            self, instance: Instance, now: float | None = None
        ) -> BreakerState: ...

    def partners(self, instance: Instance) -> list[Instance]:
        """Registered instances of the other side that may form a pair with
        ``instance``: the same model, and the same model fingerprint (an
        unknown one, static instances', pairs with any)."""
        other = Role.PREFILL if instance.role is Role.DECODE else Role.DECODE
        return [
            i
            for i in self._instances.values()
            if i is not instance
            and i.serves(other)
            and (i.model is None or instance.model is None or i.model == instance.model)
            and compatible(i, instance)
        ]

    def models(self) -> list[str]:
        """Model names the registered instances serve, sorted."""
        self.expire()
        return sorted(
            {i.model for i in self._instances.values() if i.model is not None}
        )

    def model_names(self) -> list[str]:
        """Every name a request may use: models and their aliases, sorted."""
        self.expire()
        return self._index.names()

    def unpaired_counts(self) -> dict[str, int]:
        """Instances no instance of the other side can pair with, by role:
        their model fingerprints differ from every one of the other side's
        (other weights, config or layout under one model name)."""
        self.expire()
        counts = dict.fromkeys((r.value for r in Role), 0)
        for instance in self._instances.values():
            if not self.has_partner(instance):
                counts[instance.role.value] += 1
        return counts

    def stalled_counts(self) -> dict[str, int]:
        """Instances out of rotation because they stopped stepping, by role."""
        self.expire()
        counts = dict.fromkeys((r.value for r in Role), 0)
        for instance in self._instances.values():
            if instance.stalled:
                counts[instance.role.value] += 1
        return counts

    def dp_groups(self) -> dict[str, list[str]]:
        """DP group -> the instance ids of its registered ranks, by rank."""
        self.expire()
        return {
            key: [m.instance_id for m in sorted(group.members, key=lambda m: m.dp_rank)]
            for key, group in sorted(self._index.groups.items())
        }

    def counts(self) -> dict[str, int]:
        """Registered instances by role (``prefill``, ``decode``, ``both``)."""
        self.expire()
        counts = dict.fromkeys((r.value for r in Role), 0)
        for instance in self._instances.values():
            counts[instance.role.value] += 1
        return counts

    def snapshot(self) -> list[dict[str, Any]]:
        """One JSON-able dict per instance, for the listing endpoint."""
        self.expire()
        now = self.clock()
        return [
            {
                "instance_id": i.instance_id,
                "role": i.role.value,
                "http_addr": i.http_addr,
                "kv_addr": i.kv_addr,
                "model": i.model,
                "aliases": list(i.aliases),
                "dp_rank": i.dp_rank,
                "dp_size": i.dp_size,
                "static": i.static,
                "age_s": round(now - i.first_seen, 3),
                "last_heartbeat_s": None if i.static else round(now - i.last_seen, 3),
                "outstanding": i.outstanding,
                "tokens_in_flight": i.tokens_in_flight,
                # Ranks of one DP group step together ("": none).
                "dp_group": i.dp_group,
                "breaker": self.breaker_state(i, now).value,
                "consecutive_failures": i.consecutive_failures,
                # "stalled": its engine held requests stalled_s without a step.
                "state": "stalled" if i.stalled else "ready",
                "stalled_s": i.stalled_s,
                "fingerprint": i.fingerprint,
                "max_model_len": i.max_model_len,
                # False: no instance of the other side has its fingerprint.
                "paired": self.has_partner(i),
            }
            for i in self._instances.values()
        ]
