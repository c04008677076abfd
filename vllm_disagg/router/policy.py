"""Selection policies: which of the healthy instances gets a request.

Plain classes, no quart or vLLM. A policy sees only the instances the
registry calls healthy, so no policy (affinity included) can route to an
unhealthy or removed instance.

Each policy registers its name where it is defined (``@register_policy``);
the command line offers what is registered (``policy_names``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from vllm_disagg.router.registry import Instance
from vllm_disagg.wire.discovery import Role

if TYPE_CHECKING:  # config.py lists the registered names: no import cycle
    from vllm_disagg.router.config import RouterConfig


class Policy(ABC):
    name: ClassVar[str]
    prefill_only: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: RouterConfig) -> Policy:
        """A new instance of the policy, with its options from ``config``."""
        return cls()

    @abstractmethod
    def select(
        self, candidates: Sequence[Instance], body: Mapping[str, Any]
    ) -> Instance:
        """Pick one of ``candidates`` (never empty) for the request ``body``."""


_POLICIES: dict[str, type[Policy]] = {}
_P = TypeVar("_P", bound=type[Policy])
# Modules whose policies register themselves (they import this one): loaded
# when the registry is first read, so that no import circle forms.
POLICY_MODULES = ("vllm_disagg.router.placement",)


def _registered() -> dict[str, type[Policy]]:
    for module in POLICY_MODULES:
        importlib.import_module(module)
    return _POLICIES


def register_policy(name: str, *, prefill_only: bool = False) -> Callable[[_P], _P]:
    """Register a policy class under ``name`` (the command line's value).
    ``prefill_only``: not offered for decode instances."""

    def register(cls: _P) -> _P:
        if name in _POLICIES:
            raise ValueError(f"policy {name!r} is registered twice")
        cls.name, cls.prefill_only = name, prefill_only
        _POLICIES[name] = cls
        return cls

    return register


def policy_names(side: Role) -> tuple[str, ...]:
    """The registered policies ``side`` (PREFILL or DECODE) may use, in
    registration order."""
    return tuple(
        name
        for name, cls in _registered().items()
        if side is Role.PREFILL or not cls.prefill_only
    )


@register_policy("round_robin")
class RoundRobinPolicy(Policy):
    def __init__(self) -> None:
        self._turn = 0

    def select(
        self, candidates: Sequence[Instance], body: Mapping[str, Any]
    ) -> Instance:
        self._turn += 1
        return candidates[self._turn % len(candidates)]


_OUTSTANDING = attrgetter("outstanding")  # a C call per candidate, not a lambda


@register_policy("least_outstanding")
class LeastOutstandingPolicy(Policy):
    """Fewest requests in flight through this router; ties rotate, so an
    idle fleet is still used evenly."""

    def __init__(self) -> None:
        self._turn = 0

    def select(
        self, candidates: Sequence[Instance], body: Mapping[str, Any]
    ) -> Instance:
        self._turn += 1
        start = self._turn % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=_OUTSTANDING)


def render_prompt(body: Mapping[str, Any], limit: int | None = None) -> str:
    """The part of a request that decides its KV: every chat message (role,
    content and the rest, tools first as templates put them) or the
    completion prompt. Not the model's template, but the same prefix gives
    the same text. With ``limit``, the first ``limit`` characters, rendered
    without touching more of the body than that (a 3M-token prompt froze
    the event loop; so did a JSON rendering of 10 MB of tools)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = [render_value(body["tools"], limit)] if body.get("tools") else []
        size = sum(len(p) for p in parts)
        for message in messages:
            if limit is not None and size >= limit:
                break
            if not isinstance(message, Mapping):
                parts.append(render_value(message, limit))
            else:
                rest = {
                    k: v for k, v in message.items() if k not in ("role", "content")
                }
                parts.append(
                    f"{render_value(message.get('role'), limit)}\x1f"
                    f"{render_value(message.get('content'), limit)}"
                    f"{render_value(rest, limit) if rest else ''}"
                )
            size += len(parts[-1])
        return "\x1e".join(parts)[:limit]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        # A batch of prompts: the first one leads the text.
        return "\x1e".join(
            _prompt_text(p, limit) for p in prompt[: limit or len(prompt)]
        )[:limit]
    return _prompt_text(prompt, limit)


def _prompt_text(prompt: Any, limit: int | None) -> str:
    """One prompt: its text, or its token ids as "11,2,3" (no brackets: a
    longer prompt's text extends a shorter one's)."""
    if isinstance(prompt, str):
        return prompt[:limit]
    if isinstance(prompt, list):
        # Every id renders to at least one character: ``limit`` ids suffice.
        ids = prompt if limit is None else prompt[:limit]
        return ",".join(
            str(i) if isinstance(i, int) else render_value(i, limit) for i in ids
        )[:limit]
    return "" if prompt is None else render_value(prompt, limit)


MAX_RENDER_DEPTH = 32  # deeper parts of a value render as one marker


def render_value(value: Any, limit: int | None = None) -> str:
    """``value`` (strings as they are, everything else JSON-like) cut to
    ``limit`` characters, at a cost bounded by ``limit``: a walk over
    iterators that stops when the text is long enough, never a recursion
    (a client's nesting cannot reach the interpreter's limit) and never a
    rendering of what would be cut off."""
    budget = float("inf") if limit is None else limit
    out: list[str] = []
    size = 0

    def emit(text: str) -> None:
        nonlocal size
        text = text[: int(min(len(text), budget - size))]
        out.append(text)
        size += len(text)

    if isinstance(value, str):
        return value[:limit]
    stack: list[list[Any]] = []  # [iterator of children, closer, children so far]
    item: Any = value
    while size < budget:
        if item is _NEXT:
            if not stack:
                break
            frame = stack[-1]
            item = next(frame[0], _NEXT)
            if item is _NEXT:
                stack.pop()
                emit(frame[1])
            elif not isinstance(item, _Value):
                if frame[2]:
                    emit(",")
                frame[2] += 1
            continue
        if isinstance(item, _Key):
            emit(item.text)
            item = _NEXT
            continue
        if isinstance(item, _Value):
            item = item.value
        if isinstance(item, str):
            emit('"' + item[: int(min(len(item), budget - size))] + '"')
        elif isinstance(item, Mapping | list | tuple):
            if len(stack) >= MAX_RENDER_DEPTH:
                emit("\u2026")
            else:
                opener, closer = ("{", "}") if isinstance(item, Mapping) else ("[", "]")
                emit(opener)
                stack.append([_children(item), closer, 0])
        else:
            emit(
                str(item)
                if isinstance(item, int | float | bool) or item is None
                else type(item).__name__
            )
        item = _NEXT
    return "".join(out)


_NEXT = object()


class _Key:
    """A mapping key (the value after it is not a new child)."""

    __slots__ = ("text",)

    def __init__(self, key: Any) -> None:
        self.text = f"{key!s}:"[:256]


class _Value:
    """A mapping's value, following its key."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _children(value: Any):
    if isinstance(value, Mapping):
        for key, child in value.items():
            yield _Key(key)
            yield _Value(child)
    else:
        yield from value


MAX_PREFIX_CHUNKS = 512  # per prompt: bounds the hashing a request costs


@register_policy("prefix_aware", prefill_only=True)
class PrefixAwarePolicy(Policy):
    """Send a prompt to the prefill instance that last prefilled its longest
    known prefix, whose prefix cache most likely still holds it.

    The index maps a hash *chain* over fixed-size chunks of the rendered
    prompt (chunk i's hash covers chunks 0..i, like vLLM's block hashes) to
    the instance that last took a prompt with that prefix. It holds at most
    ``max_entries`` hashes, least recently used evicted first; a prompt's
    chunks are touched last-first, so a shared prefix outlives the tails
    that hang off it. Without a match, or when the holder has more than
    ``balance_threshold`` requests in flight above the least loaded
    candidate, the least loaded candidate is picked instead (a hot shared
    prefix must not pin all traffic on one instance).
    """

    def __init__(
        self, max_entries: int, chunk_chars: int, balance_threshold: int
    ) -> None:
        self.max_entries = max_entries
        self.chunk_chars = chunk_chars
        self.balance_threshold = balance_threshold
        self._index: OrderedDict[int, str] = OrderedDict()
        self._fallback = LeastOutstandingPolicy()
        # Prefixes longer than this many chunks route like their first part.
        self.max_chars = chunk_chars * MAX_PREFIX_CHUNKS

    @classmethod
    def from_config(cls, config: RouterConfig) -> Policy:
        return cls(
            config.prefix_index_max_entries,
            config.prefix_chunk_chars,
            config.prefix_balance_threshold,
        )

    def __len__(self) -> int:
        return len(self._index)

    def chunk_hashes(self, text: str) -> list[int]:
        """Hash chain over the full chunks of ``text`` (a partial tail is
        never reused by another prompt, as in a block-based prefix cache)."""
        hashes, previous = [], 0
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            previous = hash((previous, text[start : start + self.chunk_chars]))
            hashes.append(previous)
        return hashes

    def select(
        self, candidates: Sequence[Instance], body: Mapping[str, Any]
    ) -> Instance:
        hashes = self.chunk_hashes(render_prompt(body, self.max_chars))
        by_id = {c.instance_id: c for c in candidates}
        holder = None
        for chunk_hash in hashes:
            owner = self._index.get(chunk_hash)
            if owner is None:
                break
            holder = by_id.get(owner, holder)
        least = self._fallback.select(candidates, body)
        chosen = least
        if (
            holder is not None
            and holder.outstanding - least.outstanding <= self.balance_threshold
        ):
            chosen = holder
        self._remember(hashes, chosen.instance_id)
        return chosen

    def _remember(self, hashes: list[int], instance_id: str) -> None:
        index = self._index
        for chunk_hash in reversed(hashes):
            index[chunk_hash] = instance_id
            index.move_to_end(chunk_hash)
        while len(index) > self.max_entries:
            index.popitem(last=False)


@dataclass(frozen=True)
class Policies:
    """The policy for each side of a request."""

    prefill: Policy
    decode: Policy

    @classmethod
    def from_config(cls, config: RouterConfig) -> Policies:
        return cls(
            make_policy(config.policy_prefill, config),
            make_policy(config.policy_decode, config),
        )


def make_policy(name: str, config: RouterConfig) -> Policy:
    """The registered policy ``name``, configured from ``config``."""
    cls = _registered().get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; one of {', '.join(_POLICIES)}")
    return cls.from_config(config)
