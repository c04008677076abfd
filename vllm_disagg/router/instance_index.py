"""Lookups the registry answers without scanning its instances: who holds an
address, which model a name names, and whether an instance has any instance
of the other side to pair with (40,000 registrations each scanning every
instance slowed registration five-fold), and which ranks form each DP group.
Its ``version`` changes with every change of who is registered in which role:
what the registry's per-request candidate lists are cached against
(benchmarks/router_scale.py).
"""

from __future__ import annotations

from collections import Counter

from vllm_disagg.router.instance import DpGroup, Instance
from vllm_disagg.wire.discovery import Register, Role


class InstanceIndex:
    def __init__(self) -> None:
        # http_addr / kv_addr -> instance ids there (normally one)
        self._by_http: dict[str, set[str]] = {}
        self._by_kv: dict[str, set[str]] = {}
        # name (a model or an alias) -> {model it names: instances registering it}
        self._by_name: dict[str, Counter[str]] = {}
        # (role, model) and (role, model, fingerprint) -> count, for pairing
        self._pair_model: Counter[tuple] = Counter()
        self._pair_fp: Counter[tuple] = Counter()
        # Bumped by every add, remove and role change (all pass through
        # count_for_pairing): heartbeats of known instances leave it alone.
        self.version = 0
        # "role/dp_group" -> its registered ranks (Instance.group)
        self.groups: dict[str, DpGroup] = {}

    def add(self, instance: Instance) -> None:
        self.count_for_pairing(instance)
        self._join_group(instance)
        self._by_http.setdefault(instance.http_addr, set()).add(instance.instance_id)
        self._by_kv.setdefault(instance.kv_addr, set()).add(instance.instance_id)
        if instance.model is not None:
            for name in (instance.model, *instance.aliases):
                self._by_name.setdefault(name, Counter())[instance.model] += 1

    def remove(self, instance: Instance) -> None:
        self.count_for_pairing(instance, -1)
        self._leave_group(instance)
        for index, addr in (
            (self._by_http, instance.http_addr),
            (self._by_kv, instance.kv_addr),
        ):
            ids = index.get(addr)
            if ids is not None:
                ids.discard(instance.instance_id)
                if not ids:
                    del index[addr]
        if instance.model is not None:
            for name in (instance.model, *instance.aliases):
                holders = self._by_name.get(name)
                if holders is not None:
                    holders[instance.model] -= 1
                    if holders[instance.model] <= 0:
                        del holders[instance.model]
                    if not holders:
                        del self._by_name[name]

    def change_role(self, instance: Instance, role: Role) -> None:
        """``instance`` now serves ``role``: re-count its pairing and group."""
        self.count_for_pairing(instance, -1)
        self._leave_group(instance)
        instance.role = role
        self.count_for_pairing(instance)
        self._join_group(instance)

    def _join_group(self, instance: Instance) -> None:
        """Ranks of one DP group (same role: a prefill and a decode never
        share one) are placed as one (``policy.py``: dp_balanced)."""
        if not instance.dp_group:
            return
        key = f"{instance.role.value}/{instance.dp_group}"
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = DpGroup(instance.dp_group)
        group.members.append(instance)
        instance.group = group

    def _leave_group(self, instance: Instance) -> None:
        group = instance.group
        if group is None:
            return
        group.members.remove(instance)
        instance.group = None
        if not group.members:
            self.groups.pop(f"{instance.role.value}/{instance.dp_group}", None)

    def count_for_pairing(self, instance: Instance, sign: int = 1) -> None:
        """Count ``instance`` (sign -1: uncount it) in the pairing index
        only: what changes when its role does."""
        self.version += 1
        self._pair_model[(instance.role, instance.model)] += sign
        self._pair_fp[(instance.role, instance.model, instance.fingerprint)] += sign

    def ids_at(self, http_addr: str, kv_addr: str | None = None) -> set[str]:
        """Instance ids holding ``http_addr`` (or ``kv_addr``)."""
        ids = set(self._by_http.get(http_addr, ()))
        if kv_addr is not None:
            ids |= self._by_kv.get(kv_addr, set())
        return ids

    def name_conflict(self, msg: Register) -> str | None:
        """A name of ``msg`` that already names another model: requests for
        it would go to either model in turn."""
        for name in (msg.model, *msg.aliases):
            holders = self._by_name.get(name, {})
            if any(model != msg.model for model in holders):
                return name
        return None

    def names(self) -> list[str]:
        """Every model name and alias registered, sorted."""
        return sorted(self._by_name)

    def has_partner(self, instance: Instance) -> bool:
        """Whether an instance of the other side may pair with ``instance``:
        the same model, and the same model fingerprint (an unknown one pairs
        with any)."""
        if instance.role is Role.BOTH:
            return True
        other = Role.DECODE if instance.role is Role.PREFILL else Role.PREFILL
        for role in (other, Role.BOTH):
            if instance.model is None:
                if any(n > 0 for (r, _), n in self._pair_model.items() if r is role):
                    return True
                continue
            for model in (instance.model, None):
                if not instance.fingerprint:
                    if self._pair_model[(role, model)] > 0:
                        return True
                elif (
                    self._pair_fp[(role, model, instance.fingerprint)] > 0
                    or self._pair_fp[(role, model, "")] > 0
                ):
                    return True
        return False

    def other_side_fingerprints(self, instance: Instance) -> set[str]:
        """Distinct fingerprints (12 characters, "none" for unknown) of the
        other side's instances of ``instance``'s model."""
        return {
            fp[:12] or "none"
            for (role, model, fp), n in self._pair_fp.items()
            if n > 0 and model == instance.model and role is not instance.role
        }
