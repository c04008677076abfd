"""One client request on its way through the router, and the bodies its
two legs get: the prefill-only body P gets and the decode body D gets, both
naming the same peers.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_disagg.router.metrics import Outcome, RouterMetrics
from vllm_disagg.router.registry import Instance
from vllm_disagg.router.replies import Reply, error_reply
from vllm_disagg.router.validation import streams
from vllm_disagg.wire.grants import GRANT_KEY, make_grant
from vllm_disagg.wire.peers import (
    DECODE_MARKER,
    PEER_INFO_KEYS,
    PREFILL_MARKER,
    make_kv_transfer_params,
)

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
        "proxy-connection",
        "http2-settings",
        # The router's own view replaces the client's (forwarded_headers).
        "x-forwarded-for",
        "forwarded",
        "x-real-ip",
    }
)
# Body fields a prefill-only pass cannot carry: it is not streamed
# (stream_options, which vLLM refuses without stream), produces exactly one
# token (min_tokens above 1 is invalid with max_tokens 1) and no fan-out
# (best_of, beam search: those requests go to the decode alone), and reads no
# prompt logprobs (those go to the decode alone too). Everything else is
# carried, so P validates it exactly as D would and refuses what D would
# refuse before anything is prefilled: stop strings and stop token ids
# included (checked against P's vocabulary). They cannot keep P's one token
# from being computed or its KV from being sent: the connector sends the KV
# once the prompt is computed, whatever ends the request. What these dropped
# fields would make vLLM refuse sends the request to the decode alone
# (validation.decode_alone_reason).
_PREFILL_DROPPED = (
    "stream_options",
    "min_tokens",
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


def forwarded_headers(
    headers: Mapping[str, str], client: str | None = None
) -> dict[str, str]:
    """The client's headers that every leg carries: not the hop-by-hop ones
    (those its ``Connection`` names too), and ``X-Forwarded-For`` as a proxy
    sends it, the client's address (``client``) appended; no ``Forwarded``
    or ``X-Real-IP`` (a vLLM trusting its proxy would log the client's own
    claim as its address)."""
    items = list(headers.items())  # every value of a repeated header
    hop = set(_NOT_FORWARDED)
    for name, value in items:
        if name.lower() == "connection":
            hop.update(n.strip().lower() for n in value.split(","))
    sent = {k: v for k, v in items if k.lower() not in hop}
    if client:
        chain = [v for k, v in items if k.lower() == "x-forwarded-for"]
        sent["X-Forwarded-For"] = ", ".join([*chain, client])
    return sent


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


def prefill_body(
    body: Mapping[str, Any], peers: dict[str, str], path: str = "/v1/completions"
) -> dict[str, Any]:
    """The body P gets: the prompt exactly as the client sent it, one token,
    no streaming; the client's validated options (stop strings included).
    Where the token limit lives depends on the endpoint's request model
    (``path``): ``/v1/responses`` has ``max_output_tokens`` (and stores
    nothing, runs nothing in the background on P), ``/inference/v1/generate``
    its ``sampling_params``; the others (``/invocations`` takes a completion
    or a chat) ``max_tokens``."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    params = _with_peers(body.get("kv_transfer_params"), peers)
    out["stream"] = False
    if path == "/v1/responses":
        out.update(max_output_tokens=1, store=False, background=False)
    elif path == "/inference/v1/generate":
        sampling = body.get("sampling_params")
        sampling = dict(sampling) if isinstance(sampling, Mapping) else {}
        for name in _PREFILL_DROPPED:
            sampling.pop(name, None)
        out["sampling_params"] = {**sampling, "max_tokens": 1}
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in body:
            out["max_completion_tokens"] = 1
    if path == "/v1/messages" and params is not None:
        # vLLM's own P/D marker: its Messages model then skips the
        # thinking budget check (budget below max_tokens) on this leg only.
        params["do_remote_decode"] = True
    return _set_params(out, params)


def decode_body(
    body: Mapping[str, Any], peers: dict[str, str] | None
) -> dict[str, Any]:
    """The body D gets: the client's, peers named (None: D prefills itself)."""
    return _set_params(dict(body), _with_peers(body.get("kv_transfer_params"), peers))


@dataclass
class Exchange:
    """One client request on its way through the router; its outcome is
    counted once, by whichever part of the router ends it first."""

    endpoint: str  # metrics label
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    deadline: float
    metrics: RouterMetrics
    started: float = field(default_factory=time.monotonic)
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The X-Request-Id both legs carry: vLLM builds the response's id from
    # it, so it names neither instance nor the transfer key.
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    upstream_s: float = 0.0  # time spent waiting on instances, up to the first byte
    # Its estimated prompt + output tokens (prompt_size.py): the load its
    # leases add to instances' tokens_in_flight.
    load_tokens: int = 0
    prompt_tokens: int = 0  # the part its prefill leg adds
    # Why the endpoint goes to the decode alone whatever the body says
    # (routes.py), or None: a generation the router disaggregates.
    alone: str | None = None
    # The body is sent as Python's json encodes it (NaN, lone surrogates).
    stdlib_json: bool = False
    counted: bool = False
    # Migration (migrator.py): the stream's ledger when it can continue on
    # another pair, why it cannot, whether it may run again elsewhere before
    # its first byte, and the decodes that failed it (never tried again).
    ledger: Any = None
    not_migratable: str | None = None
    restartable: bool = False
    failed_decodes: set[str] = field(default_factory=set)
    migrations: int = 0
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

    def renew_key(self) -> None:
        """A fresh transfer key before the request runs on another pair: the
        KV sent under the old one may still sit in a prefill's buffer."""
        self.key = uuid.uuid4().hex
        self._names.clear()

    def continuation(self, body: dict[str, Any]) -> Exchange:
        """The exchange a migrated stream's continuation runs as: a
        ``/v1/completions`` body, this request's id, deadline and headers,
        a transfer key of its own; its outcome is this request's."""
        return Exchange(
            self.endpoint,
            "/v1/completions",
            body,
            self.headers,
            self.deadline,
            self.metrics,
            request_id=self.request_id,
            counted=True,
        )

    @property
    def model(self) -> str | None:
        model = self.body.get("model")
        return model if isinstance(model, str) else None

    @property
    def stream(self) -> bool:
        # vLLM's pydantic model takes "true", 1, ... as true: stream those too.
        return streams(self.body)

    def encode(self, body: dict[str, Any]) -> bytes:
        """A leg's body as JSON: Python's ``json`` for a body only it read."""
        if self.stdlib_json:
            return json.dumps(body).encode()
        return msgspec.json.encode(body)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def count(self, outcome: Outcome) -> None:
        """Count the request's outcome, once."""
        if not self.counted:
            self.counted = True
            self.metrics.requests.labels(self.endpoint, outcome).inc()

    def error(
        self, outcome: Outcome, status: int, message: str, param: str | None = None
    ) -> Reply:
        """Count ``outcome`` and answer with vLLM's JSON error."""
        self.count(outcome)
        return error_reply(status, message, param)

    def first_byte(self) -> None:
        """The client gets its first byte: what the router added to the wait."""
        elapsed = time.monotonic() - self.started
        self.metrics.added_latency.observe(max(0.0, elapsed - self.upstream_s))
