"""The instances a router may send requests to, and whether each is usable.

Plain Python (no quart, no vLLM, no asyncio): one event loop owns a registry
and calls it without locks. Time comes from an injectable clock, so tests
drive heartbeat expiry and circuit breakers without sleeping.

An instance is usable while

* it heartbeats (``Register`` every few seconds; silent for longer than the
  heartbeat timeout: removed), or it was named on the command line (static:
  never expires);
* its engine makes progress: a heartbeat whose ``stalled_s`` (seconds its
  engine held requests without a step) reached ``stall_timeout_s`` takes it
  out of rotation (and ends its prefill legs) until one says it steps again;
* its circuit breaker (``circuit_breaker.py``) is closed, or half-open with
  no trial in flight: ``breaker_failures`` consecutive failures open it for
  ``breaker_cooldown_s``, then one request may try it; success closes it,
  failure opens it again.

A request holds an instance through a :class:`Lease` (``reserve``): the
instance counts it in its load until the lease's one ``release(ok)``, which
also tells the breaker what the instance did.

A refused connection proves nothing listens there: a registered instance is
removed at once (a live one comes back with its next heartbeat), a static one
gets its breaker opened (it has no heartbeat to come back with).

Replays: each heartbeat of an instance must carry a larger ``seq`` than the
last one accepted (its counter for this router, see the connector's
``registration.py``), and an instance removed (deregistered, expired,
unreachable) is remembered with its last ``seq`` (``departures.py``): only
a newer heartbeat of it brings it back, never an old frame. Beyond that
time, an old frame's ``sent_at`` is outside discovery's clock window
(``wire/clocks.py``) and refused there.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_disagg.router.circuit_breaker import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
)
from vllm_disagg.router.departures import Departures
from vllm_disagg.router.instance import Instance, Lease
from vllm_disagg.router.instance_index import InstanceIndex
from vllm_disagg.router.registry_views import RegistryViews
from vllm_disagg.wire.discovery import Register, Role
from vllm_disagg.wire.logs import RateLimitedLog

logger = logging.getLogger(__name__)


class RegistryRefused(RuntimeError):
    """A registration the registry will not take; ``kind`` is the counter label."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


class RegistryFull(RegistryRefused):
    """A registration beyond ``max_instances``: refused (the Ack says why)."""

    def __init__(self, detail: str):
        super().__init__("full", detail)


# Why instances leave the registry (the reason label of instance_removals).
REMOVAL_REASONS = ("replaced", "deregistered", "expired", "unreachable")
# (side, model) candidate lists kept between membership changes; more are
# dropped at once (a model name comes from a client).
MAX_SERVING_LISTS = 256


@dataclass
class InstanceRegistry(RegistryViews):
    heartbeat_timeout_s: float = 10.0
    stall_timeout_s: float = 20.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    max_instances: int = 4096
    _instances: dict[str, Instance] = field(default_factory=dict, init=False)
    # Addresses, names and pairing, looked up without a scan.
    _index: InstanceIndex = field(default_factory=InstanceIndex, init=False)
    # No heartbeat deadline falls before this (a lower bound): until then
    # expire() skips its scan, which ran on every request (1,000 instances:
    # three scans per request).
    _next_expiry: float = field(default=-float("inf"), init=False)
    # (side, model) -> instances serving it, for the index version they are of.
    _serving: dict[tuple[Role, str | None], tuple[Instance, ...]] = field(
        default_factory=dict, init=False
    )
    _serving_version: int = field(default=-1, init=False)
    # Instances stalled or with a breaker not closed: the only ones healthy()
    # checks one by one (a check of every candidate was half the selection).
    _suspects: dict[str, Instance] = field(default_factory=dict, init=False)
    # Retired incarnations and removed instances: their old frames are refused.
    _departed: Departures = field(default_factory=Departures, init=False)
    # What happened to instances, for /metrics: removals by reason, breaker opens.
    # Every reason starts at 0: a series that appears only with its first
    # event hides that event from rate() and increase() (and so from alerts).
    removals: Counter[str] = field(
        default_factory=lambda: Counter(dict.fromkeys(REMOVAL_REASONS, 0)),
        init=False,
    )
    breaker_opens: int = field(default=0, init=False)
    # Called with (instance, reason) after an instance is removed (the proxy
    # ends its legs to an instance whose heartbeats stopped).
    on_removed: list[Callable[[Instance, str], None]] = field(
        default_factory=list, init=False
    )
    # Called with the instance when its heartbeats say it stopped stepping.
    on_stalled: list[Callable[[Instance], None]] = field(
        default_factory=list, init=False
    )
    stalls: int = field(default=0, init=False)
    # Breaker state changes by (old, new) state, and leases collected unreleased.
    breaker_transitions: Counter[tuple[str, str]] = field(
        default_factory=Counter, init=False
    )
    leaked_leases: int = field(default=0, init=False)
    _leak_log: RateLimitedLog = field(
        default_factory=lambda: RateLimitedLog(logger), init=False, repr=False
    )

    # --- membership ------------------------------------------------------

    def register(self, msg: Register) -> bool:
        """Add or refresh an instance; True when it is new.

        A new incarnation (another ``instance_id``) at an ``http_addr``
        already known replaces the old one: that process is gone.
        """
        now = self.clock()
        known = self._instances.get(msg.instance_id)
        if known is not None and (
            (
                msg.http_addr,
                msg.kv_addr,
                msg.model,
                tuple(msg.aliases),
                msg.fingerprint,
                msg.dp_group,
            )
            != (
                known.http_addr,
                known.kv_addr,
                known.model,
                known.aliases,
                known.fingerprint,
                known.dp_group,
            )
        ):
            # An incarnation keeps its addresses and names: another frame
            # under its id that changes them is not from it.
            raise RegistryRefused(
                "stale", f"{msg.instance_id}: registered with other addresses or names"
            )
        if known is None and (name := self._index.name_conflict(msg)) is not None:
            raise RegistryRefused(
                "conflict",
                f"{msg.instance_id}: the name {name!r} already names another model",
            )
        if known is not None and msg.seq <= known.seq:
            # Strictly increasing: a heartbeat replayed unchanged must not
            # keep a dead instance listed.
            raise RegistryRefused(
                "replayed",
                f"{msg.instance_id}: heartbeat {msg.seq} after {known.seq} "
                "(each must be newer)",
            )
        if known is None and (refusal := self._departed.refusal(msg, now)):
            raise RegistryRefused(*refusal)
        # An address belongs to one instance: a newer incarnation (a later
        # sender clock) takes it over; an older one (a replayed frame) may not.
        others = [
            self._instances[i]
            for i in sorted(
                self._index.ids_at(msg.http_addr, msg.kv_addr) - {msg.instance_id}
            )
        ]
        for other in others:
            if msg.sent_at < other.sent_at:
                raise RegistryRefused(
                    "stale",
                    f"{msg.instance_id}: {other.instance_id} holds "
                    "its address with a newer registration",
                )
        for other in others:
            self._remove(other, "replaced")
            self._departed.retire(other.instance_id, now)
        if known is None and len(self._instances) >= self.max_instances:
            raise RegistryFull(
                f"the registry holds {self.max_instances} instances already"
            )
        expires_after_s = max(self.heartbeat_timeout_s, 3 * msg.interval_s)
        if known is not None:
            if known.role is not msg.role:
                self._index.change_role(known, msg.role)
            known.seq, known.sent_at = msg.seq, msg.sent_at
            known.dp_rank, known.dp_size = msg.dp_rank, msg.dp_size
            known.max_model_len = msg.max_model_len
            known.last_seen, known.expires_after_s = now, expires_after_s
            self._next_expiry = min(self._next_expiry, now + expires_after_s)
            self._progress(known, msg.stalled_s)
            return False
        instance = self._instances[msg.instance_id] = Instance(
            msg.instance_id,
            msg.role,
            msg.http_addr,
            msg.kv_addr,
            msg.model,
            msg.dp_rank,
            msg.dp_size,
            now,
            now,
            expires_after_s,
            aliases=tuple(msg.aliases),
            seq=msg.seq,
            sent_at=msg.sent_at,
            fingerprint=msg.fingerprint,
            max_model_len=msg.max_model_len,
            dp_group=msg.dp_group if msg.dp_size > 1 else "",
            breaker=self._new_breaker(msg.instance_id, msg.http_addr),
        )
        self._departed.returned(msg.instance_id)  # a newer heartbeat: it lives
        self._next_expiry = min(self._next_expiry, now + expires_after_s)
        self._index.add(instance)
        self._progress(instance, msg.stalled_s)
        logger.info(
            "instance %s joined: %s http=%s kv=%s model=%s dp=%d/%d%s",
            msg.instance_id,
            msg.role.value,
            msg.http_addr,
            msg.kv_addr,
            msg.model,
            msg.dp_rank,
            msg.dp_size,
            f" group={instance.dp_group}" if instance.dp_group else "",
        )
        if not self.has_partner(instance):
            others = self._index.other_side_fingerprints(instance)
            if others:
                logger.warning(
                    "instance %s (%s) is unpaired: its model fingerprint %s matches "
                    "no %s of model %s (theirs: %s): other weights, config, "
                    "tokenizer, dtype or layout under one name",
                    instance.instance_id,
                    instance.role.value,
                    instance.fingerprint[:12] or "none",
                    "decode" if instance.role is Role.PREFILL else "prefill",
                    instance.model,
                    ", ".join(sorted(others)),
                )
        return True

    def _progress(self, instance: Instance, stalled_s: float) -> None:
        """Take ``instance`` out of rotation while its engine does not step."""
        instance.stalled_s = stalled_s
        stalled = stalled_s >= self.stall_timeout_s
        if stalled == instance.stalled:
            return
        instance.stalled = stalled
        self._suspect(instance)
        if stalled:
            self.stalls += 1
            logger.warning(
                "instance %s (%s): its engine has held requests for %.0f s without "
                "a step; no new requests until it steps again",
                instance.instance_id,
                instance.http_addr,
                stalled_s,
            )
            for callback in self.on_stalled:
                callback(instance)
        else:
            logger.info(
                "instance %s (%s) steps again: back in rotation",
                instance.instance_id,
                instance.http_addr,
            )

    def add_static(
        self, role: Role, http_addr: str, kv_addr: str, model: str | None
    ) -> Instance:
        """An instance named on the command line: never expires."""
        now = self.clock()
        instance_id = f"static-{role.value}-{http_addr}"
        instance = Instance(
            instance_id,
            role,
            http_addr,
            kv_addr,
            model,
            0,
            1,
            now,
            now,
            None,
            breaker=self._new_breaker(instance_id, http_addr),
        )
        self._instances[instance_id] = instance
        self._index.add(instance)
        return instance

    def deregister(self, instance_id: str) -> bool:
        instance = self._instances.get(instance_id)
        if instance is None:
            return False
        self._remove(instance, "deregistered")
        return True

    def expire(self) -> list[Instance]:
        """Remove the instances whose heartbeats stopped; returns them."""
        now = self.clock()
        if now < self._next_expiry:
            return []
        gone = [
            i
            for i in self._instances.values()
            if i.expires_after_s is not None and now - i.last_seen > i.expires_after_s
        ]
        for instance in gone:
            self._remove(instance, "expired")
        # 1 ms early: ``now - last_seen > after`` and ``now > last_seen +
        # after`` may round apart.
        self._next_expiry = min(
            (
                i.last_seen + i.expires_after_s - 1e-3
                for i in self._instances.values()
                if i.expires_after_s is not None
            ),
            default=float("inf"),
        )
        return gone

    def mark_unreachable(self, http_addr: str) -> None:
        """Its connection was refused: stop sending there now."""
        for instance_id in sorted(self._index.ids_at(http_addr)):
            instance = self._instances[instance_id]
            if instance.static:
                instance.breaker.trip(self.clock())
            else:
                self._remove(instance, "unreachable")

    def _remove(self, instance: Instance, reason: str) -> None:
        del self._instances[instance.instance_id]
        self._suspects.pop(instance.instance_id, None)
        self._index.remove(instance)
        if not instance.static:
            self._departed.remember_removed(
                instance.instance_id, instance.seq, instance.sent_at, self.clock()
            )
        self.removals[reason] += 1
        logger.info(
            "instance %s (%s %s) removed: %s",
            instance.instance_id,
            instance.role.value,
            instance.http_addr,
            reason,
        )
        for callback in self.on_removed:
            callback(instance, reason)

    # --- selection support -----------------------------------------------

    def healthy(self, side: Role, model: str | None = None) -> list[Instance]:
        """Instances that may take a request for ``side`` (PREFILL or DECODE)
        now, serving ``model`` (None: any), in registration order."""
        self.expire()
        members = self._serving_list(side, model)
        if self._suspects:
            now = self.clock()
            out = {
                i.instance_id
                for i in list(self._suspects.values())
                if i.stalled or not i.breaker.admits(now)
            }
            if out:
                return [i for i in members if i.instance_id not in out]
        return list(members)

    def _serving_list(self, side: Role, model: str | None) -> tuple[Instance, ...]:
        """Registered instances serving ``side`` and ``model``, in registration
        order, rebuilt only after a membership or role change (heartbeats
        change neither)."""
        if self._serving_version != self._index.version:
            self._serving.clear()
            self._serving_version = self._index.version
        members = self._serving.get((side, model))
        if members is None:
            if len(self._serving) >= MAX_SERVING_LISTS:
                self._serving.clear()
            members = self._serving[(side, model)] = tuple(
                i
                for i in self._instances.values()
                if i.serves(side) and i.answers_to(model)
            )
        return members

    def serves_model(self, model: str) -> bool:
        """Whether any registered instance, healthy or not, serves ``model``."""
        return any(i.answers_to(model) for i in self._instances.values())

    def reserve(self, instance: Instance, tokens: int = 0) -> Lease:
        """A request is sent to ``instance``: it holds it until the lease's
        ``release``, the only way the reservation ends. ``tokens``: its
        estimated size, counted in ``tokens_in_flight`` meanwhile."""
        instance.outstanding += 1
        instance.tokens_in_flight += tokens
        instance.breaker.request_started(self.clock())
        return Lease(instance, self._end_lease, tokens)

    def _end_lease(self, lease: Lease, ok: bool | None, leaked: bool) -> None:
        instance = lease.instance
        instance.outstanding -= 1
        instance.tokens_in_flight -= lease.tokens
        instance.breaker.request_ended()
        if leaked:
            self.leaked_leases += 1
            self._leak_log.warning(
                "leaked-lease",
                "instance %s (%s): a request's lease was never released "
                "(%d so far); released now with no verdict",
                instance.instance_id,
                instance.http_addr,
                self.leaked_leases,
            )
        if ok is not None:
            self.report(instance, ok)

    def report(self, instance: Instance, ok: bool) -> None:
        """What the instance did, for its breaker (no request accounting)."""
        instance.breaker.record(ok, self.clock())

    def breaker_state(
        self, instance: Instance, now: float | None = None
    ) -> BreakerState:
        return instance.breaker.state(self.clock() if now is None else now)

    def _new_breaker(self, instance_id: str, http_addr: str) -> CircuitBreaker:
        return CircuitBreaker(
            BreakerConfig(self.breaker_failures, self.breaker_cooldown_s),
            f"instance {instance_id} ({http_addr})",
            lambda breaker, old, new: self._breaker_transition(
                breaker, old, new, instance_id
            ),
        )

    def _breaker_transition(
        self,
        breaker: CircuitBreaker,
        old: BreakerState,
        new: BreakerState,
        instance_id: str | None = None,
    ) -> None:
        self.breaker_transitions[(old.value, new.value)] += 1
        if new is BreakerState.OPEN:
            self.breaker_opens += 1
        instance = self._instances.get(instance_id) if instance_id else None
        if instance is not None and instance.breaker is breaker:
            self._suspect(instance)

    def _suspect(self, instance: Instance) -> None:
        """Track whether ``instance`` may be unhealthy: stalled, or its
        breaker open or half-open (from its state, not from the event)."""
        if (
            instance.stalled
            or instance.breaker.state(self.clock()) is not BreakerState.CLOSED
        ):
            self._suspects[instance.instance_id] = instance
        else:
            self._suspects.pop(instance.instance_id, None)

    # --- lookups (the listing and /metrics views: registry_views.py) -------

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def __len__(self) -> int:
        return len(self._instances)

    def has_partner(self, instance: Instance) -> bool:
        """:meth:`partners` is not empty, from the index (no scan)."""
        return self._index.has_partner(instance)
