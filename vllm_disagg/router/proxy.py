"""How one client request becomes a prefill request and a decode request.

For each request the router picks a decode instance D and a prefill
instance P, names both in the request (the ``X-Request-Id`` the connector
parses, and the same peers in ``kv_transfer_params``), sends P a prefill-only
version of the body and D the original body, and relays D's answer.

* ``sequential`` hand-off: D is sent the request once P answered. A failed P
  (connection error, 5xx, timeout) is retried on another P, at most
  ``max_retries`` times: nothing has reached the client yet.
* ``concurrent`` hand-off: P and D are sent the request at once, D waits for
  the KV. This saves P's round trip on every request; a P that fails cannot be
  retried (D already waits for that P), D recomputes the prompt instead.

Each leg has its own timeout, all of them within the request deadline.
Nothing in here raises into the HTTP layer: every failure becomes a JSON
error ``Reply`` (before the first byte) or the end of the stream (after it).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.metrics import Outcome, RouterMetrics
from vllm_disagg.router.policy import Policies
from vllm_disagg.router.registry import Instance, InstanceRegistry, Lease, compatible
from vllm_disagg.router.validation import decode_alone_reason, streams
from vllm_disagg.wire.discovery import Role
from vllm_disagg.wire.grants import GRANT_KEY, make_grant
from vllm_disagg.wire.logs import RateLimitedLog
from vllm_disagg.wire.peers import (
    DECODE_MARKER,
    PEER_INFO_KEYS,
    PREFILL_MARKER,
    make_kv_transfer_params,
)

logger = logging.getLogger(__name__)

JSON = "application/json"
UPSTREAM_KEEPALIVE_S = 4.0
MODELS_CACHE_S = 10.0
MODELS_CACHE_ENTRIES = 256
EXPIRY_SWEEP_S = 1.0  # how often silent instances are looked for without traffic
# Headers of the client's request that are not passed on: hop-by-hop ones,
# those the router sets itself, and Quart's Remote-Addr.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-type",
        "accept-encoding",
        "expect",
        "x-request-id",
        "remote-addr",
    }
)
# Body fields a prefill-only pass must not see: it is not streamed, produces
# exactly one token, and must neither stop nor fail on the client's
# generation options. What stays is validated by P exactly as D would
# validate it (logprobs, n: cheap for one token), so a request D would refuse
# is refused before anything is prefilled; what max_tokens=1 would hide
# (min_tokens, and invalid values of the dropped fields) sends the request to
# the decode alone (validation.decode_alone_reason).
_PREFILL_DROPPED = (
    "stream_options",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "include_stop_str_in_output",
    "best_of",
    "use_beam_search",
    "prompt_logprobs",
)


_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


def client_request_id(value: str | None) -> str | None:
    """The client's ``X-Request-Id`` when both legs may carry it, as vLLM
    would (its response ``id`` is built from it): up to 128 of
    ``[A-Za-z0-9_.:-]``, and nothing the connector would read as peers (the
    request-id codec's markers). Otherwise None: the router's own."""
    if value is None or not _CLIENT_ID_RE.match(value):
        return None
    if PREFILL_MARKER in value or DECODE_MARKER in value:
        return None
    return value


@dataclass
class Reply:
    """What the HTTP layer sends: a whole body or a stream of chunks."""

    status: int
    content_type: str
    body: bytes | AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)  # relayed from the instance


# vLLM's names for its own errors (entrypoints/serve/exception_handling), and
# the same style for the gateway errors only a router has.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
# What vLLM calls a request its FastAPI layer refused (body, content type).
VALIDATION_ERROR_TYPE = "Bad Request"


# What vLLM's error messages never show (its sanitize_message): memory
# addresses, traceback lines, local paths (a model's path is its default name).
_SANITIZE = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)


def sanitize_message(message: str) -> str:
    for pattern, replacement in _SANITIZE:
        message = pattern.sub(replacement, message)
    return message.strip()


def error_json(
    status: int, message: str, param: str | None = None, error_type: str | None = None
) -> bytes:
    """Upstream vLLM's ErrorResponse: ``{"error": {message, type, param, code}}``,
    the message sanitized as vLLM sanitizes its own."""
    error_type = error_type or ERROR_TYPES.get(status, "InternalServerError")
    return msgspec.json.encode(
        {
            "error": {
                "message": sanitize_message(message),
                "type": error_type,
                "param": param,
                "code": status,
            }
        }
    )


def error_reply(
    status: int, message: str, param: str | None = None, error_type: str | None = None
) -> Reply:
    return Reply(status, JSON, error_json(status, message, param, error_type))


def _with_peers(
    client_params: Any, peers: dict[str, str] | None
) -> dict[str, Any] | None:
    """The client's kv_transfer_params with the router's peers. A client
    never names peers itself: its p2p_* keys are dropped, so every address
    an instance is sent to came from a registration."""
    params = {}
    if isinstance(client_params, dict):
        params = {
            k: v
            for k, v in client_params.items()
            if k not in PEER_INFO_KEYS and k != GRANT_KEY
        }
    if peers:
        params.update(peers)
    return params or None


def _set_params(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    body.pop("kv_transfer_params", None)
    if params:
        body["kv_transfer_params"] = params
    return body


def prefill_body(body: Mapping[str, Any], peers: dict[str, str]) -> dict[str, Any]:
    """The body P gets: the prompt exactly as the client sent it, one token,
    no streaming."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return _set_params(out, _with_peers(body.get("kv_transfer_params"), peers))


def decode_body(
    body: Mapping[str, Any], peers: dict[str, str] | None
) -> dict[str, Any]:
    """The body D gets: the client's, peers named (None: D prefills itself)."""
    return _set_params(dict(body), _with_peers(body.get("kv_transfer_params"), peers))


def _out_of_descriptors(error: BaseException) -> bool:
    os_error = (
        error.os_error if isinstance(error, aiohttp.ClientConnectorError) else error
    )
    return isinstance(os_error, OSError) and os_error.errno in (
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOBUFS,
        errno.ENOMEM,
    )


def _refused(error: BaseException) -> bool:
    return isinstance(error, aiohttp.ClientConnectorError) and isinstance(
        error.os_error, ConnectionRefusedError
    )


@dataclass
class _Exchange:
    """One client request on its way through the router."""

    endpoint: str  # metrics label
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    deadline: float
    started: float = field(default_factory=time.monotonic)
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The X-Request-Id both legs carry: vLLM builds the response's id from
    # it, so it names neither instance nor the transfer key.
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    upstream_s: float = 0.0  # time spent waiting on instances, up to the first byte
    counted: bool = False
    _names: dict[tuple[str, str], tuple[str, dict[str, str]]] = field(
        default_factory=dict
    )

    def name_peers(
        self, prefill: Instance, decode: Instance, token: bytes | None
    ) -> tuple[str, dict[str, str]]:
        """The request id and kv_transfer_params both legs carry (made once
        per pair): the peers' control addresses, the transfer key and, with
        a token, the grant that vouches for them (``wire/grants.py``). Only
        in kv_transfer_params: the id, which clients see, carries none of it."""
        pair = (prefill.kv_addr, decode.kv_addr)
        if pair not in self._names:
            params = make_kv_transfer_params(prefill.kv_addr, decode.kv_addr, self.key)
            if token:
                params[GRANT_KEY] = make_grant(
                    token, prefill.kv_addr, decode.kv_addr, self.key
                )
            self._names[pair] = (self.request_id, params)
        return self._names[pair]

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None

    @property
    def stream(self) -> bool:
        # vLLM's pydantic model takes "true", 1, ... as true: stream those too.
        return streams(self.body)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class LegFailure(str, enum.Enum):
    """Why a call to an instance failed: the ``reason`` label of
    prefill_failures_total, and what log lines and errors name."""

    REFUSED = "refused"  # nothing listens there
    LOCAL = "local"  # the router's own shortage (descriptors, buffers)
    CONNECT_TIMEOUT = "connect_timeout"
    TIMEOUT = "timeout"
    CONNECTION = "connection"  # reset or closed mid-request
    ERROR = "error"
    STATUS = "status"  # it answered 5xx
    INSTANCE_REMOVED = "instance_removed"  # its heartbeats stopped mid-leg
    INSTANCE_STALLED = "instance_stalled"  # its engine stopped stepping mid-leg

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass
class _PrefillResult:
    ok: bool
    elapsed_s: float
    reason: str = ""
    # Sequential hand-off: answer the client with this instead (4xx, deadline).
    reply: Reply | None = None
    outcome: Outcome | None = None


@dataclass(eq=False)
class _PrefillLeg:
    """A prefill request in flight, which ``_instance_removed`` can end."""

    timeout: asyncio.Timeout
    lost: LegFailure | None = None  # why its instance's legs were ended


class RequestProxy:
    def __init__(
        self,
        config: RouterConfig,
        registry: InstanceRegistry,
        policies: Policies,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.registry = registry
        self.policies = policies
        self.metrics = metrics
        self._session: aiohttp.ClientSession | None = None
        self.limited_log = RateLimitedLog(logger)
        self._probing: set[str] = set()  # instance ids with a health probe in flight
        # (model, client's Authorization) -> (until, names, entries): /v1/models
        # as its decodes list it
        self._models_cache: dict[tuple, tuple[float, tuple[str, ...], list[dict]]] = {}
        self._probes: set[asyncio.Task] = set()
        # instance id -> the prefill legs in flight there (see _instance_removed)
        self._prefill_legs: dict[str, set[_PrefillLeg]] = {}
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        """One client session for every upstream call, pooled connections;
        heartbeat expiry checked every second even while no request comes."""
        self.registry.on_removed.append(self._instance_removed)
        self.registry.on_stalled.append(self._instance_stalled)
        self._sweeper = asyncio.create_task(self._sweep_expired())
        self._session = aiohttp.ClientSession(
            # An idle connection is dropped before vLLM's (uvicorn's 5 s) keep-alive
            # ends: reusing one the server is closing would fail a request.
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self.config.connect_timeout_s
            ),
        )

    async def close(self) -> None:
        if self._instance_removed in self.registry.on_removed:
            self.registry.on_removed.remove(self._instance_removed)
        if self._instance_stalled in self.registry.on_stalled:
            self.registry.on_stalled.remove(self._instance_stalled)
        for task in [*self._probes, *([self._sweeper] if self._sweeper else [])]:
            task.cancel()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "RequestProxy.start() was not called"
        return self._session

    # --- entry -----------------------------------------------------------

    async def handle(
        self, endpoint: str, path: str, body: dict[str, Any], headers: Mapping[str, str]
    ) -> Reply:
        ex = _Exchange(
            endpoint,
            path,
            body,
            {k: v for k, v in headers.items() if k.lower() not in _NOT_FORWARDED},
            deadline=time.monotonic() + self.config.request_timeout_s,
        )
        client_id = client_request_id(headers.get("X-Request-Id"))
        if client_id is not None:
            ex.request_id = client_id
        try:
            return await self._route(ex)
        except asyncio.CancelledError:
            self.count(ex, Outcome.CANCELLED)
            raise

    def count(self, ex: _Exchange, outcome: Outcome) -> None:
        """Count a request's outcome, once."""
        if not ex.counted:
            ex.counted = True
            self.metrics.requests.labels(ex.endpoint, outcome).inc()

    def _first_byte(self, ex: _Exchange) -> None:
        elapsed = time.monotonic() - ex.started
        self.metrics.added_latency.observe(max(0.0, elapsed - ex.upstream_s))

    def _error(
        self,
        ex: _Exchange,
        outcome: Outcome,
        status: int,
        message: str,
        param: str | None = None,
    ) -> Reply:
        self.count(ex, outcome)
        return error_reply(status, message, param)

    def _unknown_model(self, ex: _Exchange) -> Reply | None:
        """Upstream vLLM's 404 when no instance serves the request's model."""
        model = ex.model
        if model is None or not len(self.registry) or self.registry.serves_model(model):
            return None
        return self._error(
            ex,
            Outcome.NO_INSTANCE,
            404,
            f"The model `{model}` does not exist. Valid aliases: "
            f"{', '.join(self.registry.model_names())}.",
            "model",
        )

    def _pick(
        self,
        side: Role,
        ex: _Exchange,
        exclude: set[str] = frozenset(),
        model: str | None = None,
        partner: Instance | None = None,
    ) -> Instance | None:
        """An instance of ``side`` serving ``model`` (default: the request's)
        whose KV is ``partner``'s (the same model fingerprint)."""
        model = ex.model if model is None else model
        candidates = [
            i
            for i in self.registry.healthy(side, model)
            if i.instance_id not in exclude
            and (partner is None or compatible(i, partner))
        ]
        if not candidates:
            return None
        policy = self.policies.prefill if side is Role.PREFILL else self.policies.decode
        return policy.select(candidates, ex.body)

    def _pick_paired_decode(self, ex: _Exchange) -> Instance | None:
        """A decode that some healthy prefill can serve: the same model
        fingerprint. With no healthy prefill at all, any decode (the request
        goes on to the no-prefill handling)."""
        prefills = self.registry.healthy(Role.PREFILL, ex.model)
        if not prefills:
            return self._pick(Role.DECODE, ex)
        fingerprints = {p.fingerprint for p in prefills}
        candidates = [
            d
            for d in self.registry.healthy(Role.DECODE, ex.model)
            if not d.fingerprint or "" in fingerprints or d.fingerprint in fingerprints
        ]
        if not candidates:
            return None
        return self.policies.decode.select(candidates, ex.body)

    def _no_decode_reason(self, ex: _Exchange) -> str:
        if self.registry.healthy(Role.DECODE, ex.model):
            return (
                "no prefill and decode instance of this model can form a pair: "
                "their model fingerprints differ (other weights, config, "
                "tokenizer, dtype or layout; see /instances)"
            )
        return "no healthy decode instance is registered"

    async def _route(self, ex: _Exchange) -> Reply:
        model = ex.model
        if (unknown := self._unknown_model(ex)) is not None:
            return unknown
        if model is None and len(self.registry.models()) > 1:
            # vllm serve takes a request without `model` for its one model;
            # with several, any choice could answer with the wrong one.
            return self._error(
                ex,
                Outcome.BAD_REQUEST,
                400,
                "`model` is required: this router serves "
                f"{', '.join(self.registry.models())}",
                "model",
            )
        alone = decode_alone_reason(ex.body)
        decode = self._pick(Role.DECODE, ex) if alone else self._pick_paired_decode(ex)
        if decode is None:
            return self._error(
                ex,
                Outcome.NO_INSTANCE,
                503,
                self._no_decode_reason(ex),
            )
        # D counts as loaded from now on, prefill included: requests arriving
        # meanwhile see it, and a half-open D gets no second trial. The
        # decode leg releases the lease (or hands it to the stream relay);
        # a request that never gets there releases it here, with no verdict.
        lease = self.registry.reserve(decode)
        try:
            if alone is not None:
                self.metrics.decode_prefill_fallbacks.labels(alone).inc()
                return await self._decode(ex, lease, None)
            if self.config.handoff == "concurrent":
                return await self._concurrent(ex, lease)
            return await self._sequential(ex, lease)
        except _DecodeRefused as refused:
            return await self._decode_elsewhere(ex, decode, refused)
        finally:
            lease.release(None)

    async def _decode_elsewhere(
        self, ex: _Exchange, refused_by: Instance, refused: _DecodeRefused
    ) -> Reply:
        """D refused the connection before a byte reached the client: try
        other decodes of its model. They prefill themselves (the KV went to
        the one that refused), so the answer costs a recompute, not a 502."""
        tried = {refused_by.instance_id}
        for _ in range(self.config.max_retries):
            other = self._pick(Role.DECODE, ex, tried, model=refused_by.model)
            if other is None:
                break
            tried.add(other.instance_id)
            self.metrics.decode_retries.inc()
            try:
                return await self._decode(ex, self.registry.reserve(other), None)
            except _DecodeRefused as again:
                refused = again
        return self._error(ex, Outcome.UPSTREAM_ERROR, 502, refused.message)

    # --- endpoints one decode answers alone ---------------------------------

    async def relay(
        self, endpoint: str, method: str, path: str, body: dict | None
    ) -> Reply:
        """A request with no prefill leg (``/tokenize``, ``/detokenize``,
        ``/version``): one healthy decode of the request's model answers it,
        relayed as it is."""
        ex = _Exchange(
            endpoint,
            path,
            body or {},
            {},
            deadline=time.monotonic() + self.config.request_timeout_s,
        )
        if (unknown := self._unknown_model(ex)) is not None:
            return unknown
        decode = self._pick(Role.DECODE, ex)
        if decode is None:
            return self._error(
                ex,
                Outcome.NO_INSTANCE,
                503,
                "no healthy decode instance is registered",
            )
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": JSON} if body is not None else {}
        try:
            async with asyncio.timeout(
                min(self.config.connect_timeout_s + 30.0, ex.remaining())
            ):
                async with self.session.request(
                    method,
                    f"http://{decode.http_addr}{path}",
                    data=data,
                    headers=headers,
                ) as resp:
                    payload = await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            reason, _ = self._failed(decode, e)
            return self._error(
                ex,
                Outcome.UPSTREAM_ERROR,
                502,
                f"the decode instance failed ({reason})",
            )
        self.count(
            ex, Outcome.OK if resp.status < 400 else Outcome.UPSTREAM_CLIENT_ERROR
        )
        return Reply(resp.status, _content_type(resp), payload)

    async def refused_by_decode(
        self, endpoint: str, path: str, raw: bytes
    ) -> Reply | None:
        """A body that is not a JSON object, refused by a decode exactly as
        ``vllm serve`` refuses it (FastAPI's validation error names the
        position), before any compute; None when no decode can say (then
        the router answers itself). Only a 4xx is relayed."""
        ex = _Exchange(
            endpoint,
            path,
            {},
            {},
            deadline=time.monotonic() + self.config.connect_timeout_s + 5.0,
        )
        decode = self._pick(Role.DECODE, ex)
        if decode is None:
            return None
        try:
            async with asyncio.timeout(ex.remaining()):
                async with self.session.post(
                    f"http://{decode.http_addr}{path}",
                    data=raw,
                    headers={"Content-Type": JSON},
                ) as resp:
                    payload = await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self._failed(decode, e)
            return None
        if not 400 <= resp.status < 500:
            return None
        self.count(ex, Outcome.BAD_REQUEST)
        return Reply(resp.status, _content_type(resp), payload)

    async def list_models(self, authorization: str | None = None) -> Reply:
        """``/v1/models`` of the fleet: every model a decode serves, each
        entry as one of its decodes lists it (``root``, ``max_model_len``,
        ``permission``, aliases as their own entries), asked with the
        client's ``Authorization`` (a decode with ``--api-key`` refuses a
        client without it, and so does the router: its 401 is relayed);
        cached for MODELS_CACHE_S. A model whose decodes do not answer in
        time gets the minimal entry."""
        by_model: dict[str, Instance] = {}
        for instance in self.registry.healthy(Role.DECODE):
            if instance.model is not None:
                by_model.setdefault(instance.model, instance)
        answers = await asyncio.gather(
            *(self._models_of(i, authorization) for i in by_model.values())
        )
        for answer in answers:
            if isinstance(answer, Reply):  # refused: the client may not list models
                return answer
        data = [entry for entries in answers for entry in entries]
        return Reply(200, JSON, msgspec.json.encode({"object": "list", "data": data}))

    async def _models_of(
        self, instance: Instance, authorization: str | None
    ) -> list[dict[str, Any]] | Reply:
        names = (instance.model, *instance.aliases)
        key = (instance.model, authorization)
        cached = self._models_cache.get(key)
        now = time.monotonic()
        if cached is not None and cached[0] > now and cached[1] == names:
            return cached[2]
        entries: list[dict[str, Any]] = []
        headers = {"Authorization": authorization} if authorization else {}
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                async with self.session.get(
                    f"http://{instance.http_addr}/v1/models", headers=headers
                ) as resp:
                    payload = await resp.read()
            if resp.status in (401, 403):
                return Reply(resp.status, _content_type(resp), payload)
            listed = msgspec.json.decode(payload) if resp.status == 200 else {}
            data = listed.get("data") if isinstance(listed, dict) else None
            if isinstance(data, list):
                entries = [
                    e for e in data if isinstance(e, dict) and e.get("id") in names
                ]
        except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError):
            pass
        if not entries:
            created = int(time.time())
            entries = [
                {"id": n, "object": "model", "created": created, "owned_by": "vllm"}
                for n in names
            ]
        else:
            if len(self._models_cache) >= MODELS_CACHE_ENTRIES:
                self._models_cache.clear()  # many clients' keys: start over
            self._models_cache[key] = (now + MODELS_CACHE_S, names, entries)
        return entries

    # --- hand-off styles -------------------------------------------------

    async def _sequential(self, ex: _Exchange, lease: Lease) -> Reply:
        decode = lease.instance
        tried = {decode.instance_id}
        failures: list[str] = []
        for attempt in range(self.config.max_retries + 1):
            # The prefill computes the decode's model's KV, never another's.
            prefill = self._pick(
                Role.PREFILL, ex, tried, model=decode.model, partner=decode
            )
            if prefill is None:
                break
            tried.add(prefill.instance_id)
            if attempt:
                self.metrics.prefill_retries.inc()
            result = await self._prefill(ex, prefill, decode)
            ex.upstream_s += result.elapsed_s
            if result.ok:
                return await self._decode(ex, lease, prefill)
            if result.reply is not None:
                self.count(ex, result.outcome)
                return result.reply
            failures.append(result.reason)
            self.limited_log.warning(
                "prefill-failed",
                "prefill on %s failed: %s",
                prefill.http_addr,
                result.reason,
            )
        return await self._without_prefill(ex, lease, failures)

    async def _concurrent(self, ex: _Exchange, lease: Lease) -> Reply:
        decode = lease.instance
        prefill = self._pick(
            Role.PREFILL, ex, {decode.instance_id}, model=decode.model, partner=decode
        )
        if prefill is None:
            return await self._without_prefill(ex, lease, [])
        task = asyncio.create_task(self._concurrent_prefill(ex, prefill, decode))
        return await self._decode(ex, lease, prefill, task)

    async def _concurrent_prefill(
        self, ex: _Exchange, prefill: Instance, decode: Instance
    ) -> None:
        result = await self._prefill(ex, prefill, decode)
        if not result.ok:
            self.metrics.concurrent_prefill_failures.inc()
            self.limited_log.warning(
                "concurrent-prefill",
                "prefill on %s failed (%s) after decode on %s started: decode "
                "recomputes",
                prefill.http_addr,
                result.reason,
                decode.http_addr,
            )

    async def _without_prefill(
        self, ex: _Exchange, lease: Lease, failures: list[str]
    ) -> Reply:
        """No P could take the request: D prefills itself if allowed, else an error."""
        decode = lease.instance
        reason = "prefill_failed" if failures else "no_prefill"
        if self.config.fallback_to_decode_prefill:
            self.metrics.decode_prefill_fallbacks.labels(reason).inc()
            self.limited_log.warning(
                "fallback",
                "%s: %s prefills the request itself (%s)",
                reason,
                decode.http_addr,
                "; ".join(failures) or "no prefill instance",
            )
            return await self._decode(ex, lease, None)
        if failures:
            return self._error(
                ex,
                Outcome.UPSTREAM_ERROR,
                502,
                f"prefill failed on {len(failures)} instance(s): "
                + "; ".join(failures),
            )
        return self._error(
            ex, Outcome.NO_INSTANCE, 503, "no healthy prefill instance is registered"
        )

    # --- legs --------------------------------------------------------------

    def _post(self, ex: _Exchange, instance: Instance, body: dict, request_id: str):
        headers = {**ex.headers, "Content-Type": JSON, "X-Request-Id": request_id}
        return self.session.post(
            f"http://{instance.http_addr}{ex.path}",
            data=msgspec.json.encode(body),
            headers=headers,
        )

    def _failed(
        self, instance: Instance, error: BaseException
    ) -> tuple[LegFailure, bool | None]:
        """Why a call to ``instance`` failed, and what that says about the
        instance (``registry.finish``'s ``ok``): a refused connection drops
        it; a timeout is only a suspicion (``suspect``)."""
        if _refused(error):
            self.registry.mark_unreachable(instance.http_addr)
            return LegFailure.REFUSED, False
        if _out_of_descriptors(error):  # the router's own shortage, not the instance's
            self.limited_log.warning(
                "descriptors",
                "router: out of file descriptors or "
                "buffers (%s); lower --max-connections or raise the "
                "limit",
                error,
            )
            return LegFailure.LOCAL, None
        if isinstance(error, TimeoutError):  # aiohttp's ConnectionTimeoutError is one
            self.suspect(instance)
            if isinstance(error, aiohttp.ConnectionTimeoutError):
                return LegFailure.CONNECT_TIMEOUT, None
            return LegFailure.TIMEOUT, None
        if isinstance(error, aiohttp.ClientConnectionError):
            return LegFailure.CONNECTION, False
        return LegFailure.ERROR, False

    def suspect(self, instance: Instance) -> None:
        """A request to ``instance`` timed out. A long prompt or a long
        generation does that as well as a stuck instance, and a client must
        not be able to open an instance's breaker for everyone: the
        instance's ``/health`` decides. Only an instance that cannot answer
        it within ``connect_timeout_s`` counts a failure. One probe per
        instance at a time."""
        if instance.instance_id in self._probing:
            return
        self._probing.add(instance.instance_id)
        task = asyncio.create_task(self._probe(instance))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, instance: Instance) -> None:
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                async with self.session.get(
                    f"http://{instance.http_addr}/health"
                ) as resp:
                    healthy = resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            healthy = False
            if _refused(e):
                self.registry.mark_unreachable(instance.http_addr)
        finally:
            self._probing.discard(instance.instance_id)
        self.metrics.health_probes.labels("ok" if healthy else "failed").inc()
        if not healthy:
            self.limited_log.warning(
                "probe-failed",
                "instance %s (%s) timed out a request and does not answer /health",
                instance.instance_id,
                instance.http_addr,
            )
            self.registry.report(instance, False)

    async def _sweep_expired(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            self.registry.expire()

    def _instance_removed(self, instance: Instance, reason: str) -> None:
        """An instance whose heartbeats stopped (stopped, hung, or cut off)
        will not answer its prefill legs either: end them now, and each is
        retried on another prefill, instead of waiting out
        ``--prefill-timeout-s``. Other removals end nothing: a deregistered
        instance finishes what it has, a refused connection fails by itself."""
        if reason != "expired":
            return
        self._end_prefill_legs(instance, LegFailure.INSTANCE_REMOVED)

    def _instance_stalled(self, instance: Instance) -> None:
        """An instance whose engine stopped stepping (a hung worker behind a
        live API server) will not finish its prefill legs either: end them
        now, each retried elsewhere, not at ``--prefill-timeout-s``."""
        self._end_prefill_legs(instance, LegFailure.INSTANCE_STALLED)

    def _end_prefill_legs(self, instance: Instance, why: LegFailure) -> None:
        for leg in self._prefill_legs.pop(instance.instance_id, ()):
            leg.lost = why
            leg.timeout.reschedule(asyncio.get_running_loop().time())

    async def _prefill(
        self, ex: _Exchange, prefill: Instance, decode: Instance
    ) -> _PrefillResult:
        request_id, peers = ex.name_peers(prefill, decode, self.config.token)
        started = time.monotonic()
        ok: bool | None = None
        leg: _PrefillLeg | None = None
        lease = self.registry.reserve(prefill)
        try:
            async with asyncio.timeout(
                min(self.config.prefill_timeout_s, ex.remaining())
            ) as t:
                leg = _PrefillLeg(t)
                self._prefill_legs.setdefault(prefill.instance_id, set()).add(leg)
                body = prefill_body(ex.body, peers)
                async with self._post(ex, prefill, body, request_id) as resp:
                    data = await resp.read()
            ok = resp.status < 500
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            if leg is not None and leg.lost is not None:
                reason, ok = leg.lost, None  # already out of rotation
            else:
                reason, ok = self._failed(prefill, e)
            self.metrics.prefill_failures.labels(reason).inc()
            elapsed = time.monotonic() - started
            if reason is LegFailure.TIMEOUT and ex.remaining() <= 0:
                deadline = self._deadline_reply()
                return _PrefillResult(False, elapsed, reason, deadline, Outcome.TIMEOUT)
            return _PrefillResult(False, elapsed, reason)
        finally:
            lease.release(ok)
            legs = self._prefill_legs.get(prefill.instance_id)
            if legs is not None:
                legs.discard(leg)  # type: ignore[arg-type]
                if not legs:
                    del self._prefill_legs[prefill.instance_id]
        elapsed = time.monotonic() - started
        if resp.status >= 500:
            self.metrics.prefill_failures.labels(LegFailure.STATUS).inc()
            return _PrefillResult(False, elapsed, f"status {resp.status}")
        if resp.status >= 400:  # the request itself is wrong: D would refuse it too
            reply = Reply(resp.status, _content_type(resp), data)
            return _PrefillResult(
                False,
                elapsed,
                f"status {resp.status}",
                reply,
                Outcome.UPSTREAM_CLIENT_ERROR,
            )
        return _PrefillResult(True, elapsed)

    def _deadline_reply(self) -> Reply:
        return error_reply(
            504, f"request deadline ({self.config.request_timeout_s:g}s) exceeded"
        )

    async def _decode(
        self,
        ex: _Exchange,
        lease: Lease,
        prefill: Instance | None,
        prefill_task: asyncio.Task | None = None,
    ) -> Reply:
        """Send D its request and relay the answer. Owns ``lease``, D's
        response and ``prefill_task`` (cancelled at the end: D no longer
        waits for its KV) until a stream relay takes them over."""
        decode = lease.instance
        if prefill is not None:
            request_id, peers = ex.name_peers(prefill, decode, self.config.token)
            body = decode_body(ex.body, peers)
        else:
            request_id, body = ex.request_id, decode_body(ex.body, None)
        # Streaming: D's headers come at once, its first chunk after the KV
        # wait and the first token. Otherwise the whole answer is the first
        # byte, bounded by the request deadline only.
        first_byte_s = ex.remaining()
        if ex.stream:
            first_byte_s = min(self.config.first_token_timeout_s, first_byte_s)
        started = time.monotonic()
        resp: aiohttp.ClientResponse | None = None
        ok: bool | None = None
        try:
            async with asyncio.timeout(first_byte_s):
                resp = await self._post(ex, decode, body, request_id)
                streamed = (
                    ex.stream
                    and resp.status == 200
                    and (resp.content_type == "text/event-stream")
                )
                data = await (resp.content.readany() if streamed else resp.read())
            ex.upstream_s += time.monotonic() - started
            self._first_byte(ex)
            if streamed:
                stream = _RelayStream(
                    self, ex, lease.transfer(), resp, data, prefill_task
                )
                reply = Reply(200, _content_type(resp), stream, _relayed_headers(resp))
                resp = prefill_task = None  # the stream's now
                return reply
            ok = resp.status < 500
            if resp.status < 400:
                self.count(ex, Outcome.OK)
            else:
                self.count(
                    ex,
                    Outcome.UPSTREAM_CLIENT_ERROR if ok else Outcome.UPSTREAM_ERROR,
                )
            return Reply(resp.status, _content_type(resp), data, _relayed_headers(resp))
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            reason, ok = self._failed(decode, e)
            self.limited_log.warning(
                "decode-" + reason,
                "decode instance %s: %s: %s",
                decode.http_addr,
                reason,
                e,
            )
            if (
                reason is LegFailure.REFUSED
            ):  # nothing was sent: another decode may take it
                raise _DecodeRefused(
                    "the decode instance refused the connection"
                ) from None
            if reason is not LegFailure.TIMEOUT:
                return self._error(
                    ex,
                    Outcome.UPSTREAM_ERROR,
                    502,
                    f"the decode instance failed ({reason})",
                )
            if ex.remaining() <= 0:
                self.count(ex, Outcome.TIMEOUT)
                return self._deadline_reply()
            return self._error(
                ex,
                Outcome.TIMEOUT,
                504,
                "the decode instance sent nothing within "
                f"{self.config.first_token_timeout_s:g}s",
            )
        finally:
            lease.release(ok)  # ok None: cancelled, says nothing; moved: no-op
            if resp is not None:
                resp.release()
            if prefill_task is not None:
                prefill_task.cancel()


class _RelayStream:
    """D's streamed answer, relayed to the client chunk by chunk, byte for byte.

    Quart iterates it and calls ``aclose()`` when the client goes away; a
    client that leaves between the headers and the first chunk never
    starts the iteration, hence ``__del__``. Either way D's connection is
    closed (vLLM aborts the request) and the outcome counted once.
    """

    def __init__(
        self,
        proxy: RequestProxy,
        ex: _Exchange,
        lease: Lease,
        resp: aiohttp.ClientResponse,
        first: bytes,
        prefill_task: asyncio.Task | None,
    ) -> None:
        self._proxy = proxy
        self._ex = ex
        self._lease = lease
        self._decode = lease.instance
        self._resp = resp
        self._pending = first
        self._prefill_task = prefill_task
        self._at_event_boundary = True
        self._closed = False

    def __aiter__(self) -> _RelayStream:
        return self

    async def __anext__(self) -> bytes:
        if self._pending:
            chunk, self._pending = self._pending, b""
            return self._relay(chunk)
        if self._closed:
            raise StopAsyncIteration
        config, ex = self._proxy.config, self._ex
        try:
            async with asyncio.timeout(min(config.chunk_timeout_s, ex.remaining())):
                chunk = await self._resp.content.readany()
        except TimeoutError:
            if ex.remaining() <= 0:
                return self._end(
                    Outcome.TIMEOUT,
                    None,
                    504,
                    f"request deadline ({config.request_timeout_s:g}s) exceeded",
                )
            self._proxy.suspect(self._decode)
            return self._end(
                Outcome.TIMEOUT,
                None,
                504,
                f"the decode instance sent nothing for {config.chunk_timeout_s:g}s",
            )
        except (aiohttp.ClientError, OSError) as e:
            self._proxy.limited_log.warning(
                "stream-broken",
                "decode instance %s broke the stream: %s",
                self._decode.http_addr,
                e,
            )
            return self._end(
                Outcome.UPSTREAM_ERROR,
                False,
                502,
                "the decode instance broke the stream",
            )
        if not chunk:
            self._close(Outcome.OK, True)
            raise StopAsyncIteration
        return self._relay(chunk)

    def _relay(self, chunk: bytes) -> bytes:
        self._at_event_boundary = chunk.endswith((b"\n\n", b"\r\n\r\n"))
        return chunk

    def _end(
        self, outcome: Outcome, instance_ok: bool | None, status: int, message: str
    ) -> bytes:
        """Stop the stream after an error: an SSE error event where one fits
        (vLLM's own format), then the end of the stream."""
        self._proxy.limited_log.warning(outcome, "%s", message)
        at_boundary = self._at_event_boundary
        self._close(outcome, instance_ok)
        if not at_boundary:
            raise StopAsyncIteration
        # As vLLM ends a stream that failed: the error event, then [DONE].
        return b"data: " + error_json(status, message) + b"\n\ndata: [DONE]\n\n"

    async def aclose(self) -> None:
        self._close(Outcome.CANCELLED, None)

    def __del__(self) -> None:
        self._close(Outcome.CANCELLED, None)

    def _close(self, outcome: Outcome, instance_ok: bool | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending = b""
        self._resp.release()
        self._lease.release(instance_ok)
        self._proxy.count(self._ex, outcome)
        if self._prefill_task is not None:
            self._prefill_task.cancel()


class _DecodeRefused(Exception):
    """A decode instance refused the connection: nothing reached the client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# Response headers of the answering instance that reach the client: vLLM's
# (--enable-request-id-headers); the rest are the connection's own.
RELAYED_RESPONSE_HEADERS = ("X-Request-Id",)


def _relayed_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {h: resp.headers[h] for h in RELAYED_RESPONSE_HEADERS if h in resp.headers}


def _content_type(resp: aiohttp.ClientResponse) -> str:
    """The upstream Content-Type header as sent (charset included)."""
    return resp.headers.get("Content-Type", JSON)
