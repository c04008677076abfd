"""One registered instance, and a request's hold on one (a lease).

Plain Python, like the registry that owns them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_disagg.router.circuit_breaker import CircuitBreaker
from vllm_disagg.wire.discovery import Role

# Which registered roles can serve which side of a request.
_SERVES = {
    Role.PREFILL: (Role.PREFILL, Role.BOTH),
    Role.DECODE: (Role.DECODE, Role.BOTH),
}


@dataclass
class Instance:
    """One registered instance (one DP rank of one ``vllm serve``)."""

    instance_id: str
    role: Role
    http_addr: str
    kv_addr: str
    model: str | None  # None: a static instance with no model given, serves any
    dp_rank: int
    dp_size: int
    first_seen: float
    last_seen: float
    expires_after_s: float | None  # None: static, never expires
    outstanding: int = 0  # requests holding a lease on it (the policies' load)
    # Prompt + output tokens of the requests holding a lease on it (estimates,
    # prompt_size.py): what a DP group's step costs grow with.
    tokens_in_flight: int = 0
    # The DP group whose ranks step together ("": none, or DP=1); the registry
    # keeps ``group`` (the registered ranks of that group) up to date.
    dp_group: str = ""
    group: DpGroup | None = field(default=None, repr=False, compare=False)
    aliases: tuple[str, ...] = ()  # other names of its model
    seq: int = 0  # the last accepted heartbeat's counter (replays are older)
    sent_at: float = 0.0  # the last accepted heartbeat's sender clock
    stalled_s: float = 0.0  # the last heartbeat's: engine held requests, no step
    fingerprint: str = ""  # its model fingerprint ("": unknown, pairs with any)
    max_model_len: int = 0  # its --max-model-len (0: not known)
    stalled: bool = False  # stalled_s reached the registry's stall_timeout_s
    breaker: CircuitBreaker = field(
        default_factory=CircuitBreaker, repr=False, compare=False
    )

    @property
    def consecutive_failures(self) -> int:
        return self.breaker.consecutive_failures

    @property
    def static(self) -> bool:
        return self.expires_after_s is None

    def serves(self, side: Role) -> bool:
        return self.role in _SERVES[side]

    def answers_to(self, model: str | None) -> bool:
        """Whether a request for ``model`` (None: any) may go here."""
        return (
            model is None
            or self.model is None
            or model == self.model
            or (model in self.aliases)
        )


@dataclass(eq=False)
class DpGroup:
    """The registered ranks of one DP group: with step sync they step
    together, so each step costs what the busiest rank's batch costs."""

    group_id: str
    members: list[Instance] = field(default_factory=list)

    def max_tokens_in_flight(self, without: Instance | None = None) -> int:
        return max(
            (m.tokens_in_flight for m in self.members if m is not without), default=0
        )


def group_of(instance: Instance) -> DpGroup | None:
    """``instance``'s DP group, when it has other ranks registered."""
    group = instance.group
    return group if group is not None and len(group.members) > 1 else None


class Lease:
    """A request's hold on one instance, from :meth:`InstanceRegistry.reserve`.

    While held, the instance counts the request in its load and, when its
    breaker was half-open, as the breaker's one trial. :meth:`release` ends
    the hold once; later calls do nothing, so every path a request takes may
    release without knowing whether another already did. :meth:`transfer`
    hands the hold to whoever carries the request on (the stream relay). A
    lease collected unreleased is a bug: it is released with no verdict (it
    says nothing about the instance), counted and logged.
    """

    __slots__ = ("instance", "tokens", "_end", "_released")

    def __init__(
        self,
        instance: Instance,
        end: Callable[[Lease, bool | None, bool], None],
        tokens: int = 0,
    ) -> None:
        self.instance = instance
        self.tokens = tokens  # counted in instance.tokens_in_flight while held
        self._end = end
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self, ok: bool | None) -> None:
        """The request ended: ``ok`` True (the instance answered), False (it
        failed in a way only the instance can: refused, reset, 5xx) or None
        (says nothing about the instance: the client left, or a timeout a
        long request can cause too)."""
        if not self._released:
            self._released = True
            self._end(self, ok, False)

    def transfer(self) -> Lease:
        """A new lease holding this one's reservation; this one is released
        without ending it (its later ``release`` calls do nothing)."""
        if self._released:
            raise RuntimeError("transfer of a released lease")
        self._released = True
        return Lease(self.instance, self._end, self.tokens)

    def __del__(self) -> None:
        if not self._released:
            self._released = True
            self._end(self, None, True)


def compatible(a: Instance, b: Instance) -> bool:
    """Whether KV of one is KV of the other: equal model fingerprints (an
    instance that sent none, e.g. a static one, is taken at its word)."""
    return not a.fingerprint or not b.fingerprint or a.fingerprint == b.fingerprint
