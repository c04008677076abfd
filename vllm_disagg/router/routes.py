"""vLLM's public HTTP surface on the router: which path is answered how.

* ``GENERATIONS``: requests that generate and whose vLLM request model
  carries ``kv_transfer_params``: a prefill leg, then the decode
  (``proxy.py``). The legs go to the client's path: ``/invocations``
  dispatches by the body's shape on the instances as on a plain
  ``vllm serve``.
* ``DECODE_ALONE``: JSON POSTs one decode answers as they came (its own
  content-type check, JSON errors, model check and 403 where the feature is
  off): generations whose request model has no ``kv_transfer_params``
  (counted in ``decode_prefill_fallbacks_total``) and requests that generate
  nothing.
* ``ANY_DECODE``: GETs any decode answers (the same for every instance).
* The rest: ``/load`` (the decodes' loads summed), ``/ping`` (the router's
  readiness, as vLLM answers it), stored responses (asked of the decodes in
  turn), aborts (told to every instance).

docs/router.md has the table of every vLLM route, this one's answer and
why; ``tests/router/test_vllm_routes.py`` holds it to vLLM's own routes.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from urllib.parse import quote

import msgspec
from quart import Quart, Response, request
from werkzeug.exceptions import RequestEntityTooLarge

from vllm_disagg.router.metrics import Outcome
from vllm_disagg.router.passthrough import Asked
from vllm_disagg.router.proxy import NOT_GENERATION, STDLIB_JSON
from vllm_disagg.router.replies import JSON, VALIDATION_ERROR_TYPE, Reply, error_json
from vllm_disagg.wire.discovery import Role

# path -> metrics endpoint label
GENERATIONS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat_completions",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/invocations": "invocations",
    "/inference/v1/generate": "generate",
    "/cohere/v2/chat": "cohere_chat",
}
NO_KV_TRANSFER_PARAMS = "no_kv_transfer_params"
# path -> (metrics endpoint label, why the decode answers alone)
DECODE_ALONE = {
    "/v1/chat/completions/batch": ("chat_completions_batch", NO_KV_TRANSFER_PARAMS),
    "/v1/systemone": ("systemone", NO_KV_TRANSFER_PARAMS),
    "/generative_scoring": ("generative_scoring", NO_KV_TRANSFER_PARAMS),
    "/v1/audio/transcriptions": ("transcriptions", NO_KV_TRANSFER_PARAMS),
    "/v1/audio/translations": ("translations", NO_KV_TRANSFER_PARAMS),
    "/v1/messages/count_tokens": ("messages_count_tokens", NOT_GENERATION),
    "/tokenize": ("tokenize", NOT_GENERATION),
    "/detokenize": ("detokenize", NOT_GENERATION),
    "/v1/chat/completions/render": ("render", NOT_GENERATION),
    "/v1/completions/render": ("render", NOT_GENERATION),
    "/v1/messages/render": ("render", NOT_GENERATION),
    "/v1/responses/render": ("render", NOT_GENERATION),
    "/v1/chat/completions/derender": ("render", NOT_GENERATION),
    "/v1/completions/derender": ("render", NOT_GENERATION),
}
# path -> metrics endpoint label
ANY_DECODE = {
    "/version": "version",
    "/openapi.json": "docs",
    "/docs": "docs",
    "/docs/oauth2-redirect": "docs",
    "/redoc": "docs",
    "/tokenizer_info": "tokenizer_info",
}

_PATH_SAFE = "/:@!$&'()*+,;=-._~"  # RFC 3986's path characters, unescaped
_DOT_SEGMENTS = {".": "%2E", "..": "%2E%2E"}

# vLLM's answer to a body that is not JSON (its validate_json_request
# dependency, rendered by its validation handler).
UNSUPPORTED_MEDIA_TYPE = (
    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
)


def decode_body(raw: bytes) -> tuple[object, str, bool]:
    """The parsed body (None when it is not JSON), what is wrong with it
    unless it is a JSON object, and whether only Python's ``json`` reads it.
    Whether it is JSON is decided as vLLM decides (Starlette's
    ``json.loads`` of the bytes: UTF-8, with or without a byte-order mark,
    UTF-16 and UTF-32, ``NaN``/``Infinity``, lone surrogate escapes); msgspec
    reads it where it can (faster), and a body only ``json`` reads is sent
    to a decode alone, encoded by ``json`` again (``STDLIB_JSON``)."""
    problem = "request body must be a JSON object"
    try:
        encoding = json.detect_encoding(raw)
        if encoding != "utf-8":  # a BOM, or the zero bytes of UTF-16/32
            return (
                msgspec.json.decode(raw.decode(encoding, "surrogatepass")),
                problem,
                False,
            )
        return msgspec.json.decode(raw), problem, False
    except (msgspec.DecodeError, UnicodeError):
        pass
    except RecursionError:  # msgspec's own depth limit, not a router bug
        return None, "request body is nested too deeply", False
    try:
        return json.loads(raw), problem, True
    except UnicodeError:  # invalid UTF-8 inside a string, or a bad encoding
        return None, "request body is not UTF-8", False
    except ValueError as e:
        return None, f"request body is not JSON: {e}", False
    except RecursionError:
        return None, "request body is nested too deeply", False


def is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == JSON


def response(reply: Reply) -> Response:
    return Response(
        reply.body,
        status=reply.status,
        content_type=reply.content_type,
        headers=reply.headers,
    )


def error(
    status: int, message: str, param: str | None = None, error_type: str | None = None
) -> Response:
    return Response(
        error_json(status, message, param, error_type), status=status, content_type=JSON
    )


def _target() -> str:
    """The path and query the client asked for, as sent on: the path
    percent-encoded again (a ``%3F`` in an id stays part of the id)."""
    query = request.query_string.decode("latin-1")
    # A "." or ".." segment is an id (vLLM's path parameter), not a step up:
    # encoded, no client or server normalizes it away.
    segments = [
        _DOT_SEGMENTS.get(s) or quote(s, safe=_PATH_SAFE)
        for s in request.path.split("/")
    ]
    return "/".join(segments) + (f"?{query}" if query else "")


def register(app: Quart, state) -> None:
    """Add vLLM's routes to ``app`` (``state``: the app's RouterState)."""
    config, proxy, metrics, registry = (
        state.config,
        state.proxy,
        state.metrics,
        state.registry,
    )
    passthrough = proxy.passthrough

    async def read_body(endpoint: str) -> bytes | Response:
        declared = request.content_length
        try:
            if declared is not None and declared > config.max_body_bytes:
                raise RequestEntityTooLarge()
            return await request.get_data(cache=False)
        except RequestEntityTooLarge:
            metrics.requests.labels(endpoint, Outcome.BAD_REQUEST).inc()
            return error(
                413, f"request body larger than {config.max_body_bytes} bytes", "body"
            )

    async def forward(endpoint: str) -> Response:
        if not is_json(request.headers.get("Content-Type")):
            metrics.requests.labels(endpoint, Outcome.BAD_REQUEST).inc()
            return error(400, UNSUPPORTED_MEDIA_TYPE, None, VALIDATION_ERROR_TYPE)
        raw = await read_body(endpoint)
        if isinstance(raw, Response):
            return raw
        body, problem, stdlib_only = decode_body(raw)
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(body, dict) or not isinstance(params, dict | None):
            # vLLM's own 400 (FastAPI's error names the position or field).
            refused = await proxy.refused_by_decode(
                endpoint, request.path, raw, request.headers, request.remote_addr
            )
            if refused is not None:
                return response(refused)
            metrics.requests.labels(endpoint, Outcome.BAD_REQUEST).inc()
            if isinstance(body, dict):
                problem = "kv_transfer_params must be a JSON object"
                return error(400, problem, "kv_transfer_params", VALIDATION_ERROR_TYPE)
            return error(400, problem, "body", VALIDATION_ERROR_TYPE)
        return response(
            await proxy.handle(
                endpoint,
                request.path,
                body,
                request.headers,
                STDLIB_JSON if stdlib_only else None,
                request.remote_addr,
            )
        )

    def handler(name: str, answer: Callable[..., Awaitable[Response]], *args):
        async def view(**_: str) -> Response:  # path parameters are relayed
            return await answer(*args)

        view.__name__ = name  # Quart's endpoint names must be unique
        return view

    for path, endpoint in GENERATIONS.items():
        app.post(path)(handler(endpoint, forward, endpoint))

    async def alone(endpoint: str, reason: str) -> Response:
        raw = await read_body(endpoint)
        if isinstance(raw, Response):
            return raw
        body, _, _ = decode_body(raw)
        model = body.get("model") if isinstance(body, dict) else None
        unknown = await proxy.unknown_model(endpoint, model, request.headers)
        if unknown is not None:
            return response(unknown)
        if reason != NOT_GENERATION:
            metrics.decode_prefill_fallbacks.labels(reason).inc()
            metrics.count_route("decode_alone", reason)
        return response(
            await passthrough.one(
                Asked(
                    endpoint,
                    "POST",
                    _target(),
                    raw,
                    request.headers,
                    request.remote_addr,
                ),
                model if isinstance(model, str) else None,
            )
        )

    for path, (endpoint, reason) in DECODE_ALONE.items():
        app.post(path)(handler(f"alone{path}", alone, endpoint, reason))

    async def relay(how: Callable[[Asked], Awaitable[Reply]], endpoint: str):
        raw = None
        if request.method == "POST":
            raw = await read_body(endpoint)
            if isinstance(raw, Response):
                return raw
        asked = Asked(
            endpoint,
            request.method,
            _target(),
            raw,
            request.headers,
            request.remote_addr,
        )
        return response(await how(asked))

    for path, endpoint in ANY_DECODE.items():
        app.get(path)(handler(f"any{path}", relay, passthrough.one, endpoint))
    # A stored response lives on the decode that made it; an abort's request
    # may run on any instance.
    for method, path, how, endpoint in (
        ("GET", "/v1/responses/<id>", passthrough.in_turn, "responses_stored"),
        ("POST", "/v1/responses/<id>/cancel", passthrough.in_turn, "responses_cancel"),
        ("POST", "/inference/v1/abort_requests", passthrough.every, "abort_requests"),
        ("GET", "/load", passthrough.load, "load"),
    ):
        app.route(path, methods=[method])(handler(path, relay, how, endpoint))

    @app.route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        # vLLM's /ping is its /health: an empty 200 while it can serve.
        ready = registry.healthy(Role.PREFILL) and registry.healthy(Role.DECODE)
        answer = Response(b"", status=200 if ready else 503)
        del answer.headers["Content-Type"]  # vLLM's empty answer names no type
        return answer


# --- CORS, as vLLM's default CORSMiddleware (no allowed origins) ------------

_PREFLIGHT_VARY = (
    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
    "Access-Control-Request-Private-Network"
)
_ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")


async def preflight() -> Response | None:
    """The answer vLLM gives a CORS preflight (``OPTIONS`` with ``Origin`` and
    ``Access-Control-Request-Method``): with its default ``--allowed-origins``
    (none) every origin is refused, 400 in plain text; None for any other
    request. A coroutine, as every hook: Quart runs a plain function in a
    thread of the loop's executor, two thread hops on every request."""
    headers = request.headers
    if request.method != "OPTIONS" or "Origin" not in headers:
        return None
    method = headers.get("Access-Control-Request-Method")
    if method is None:
        return None
    answer = {
        "Vary": _PREFLIGHT_VARY,
        "Access-Control-Allow-Methods": ", ".join(_ALL_METHODS),
        "Access-Control-Max-Age": "600",
    }
    failures = ["origin"]
    if method not in _ALL_METHODS:
        failures.append("method")
    if (asked := headers.get("Access-Control-Request-Headers")) is not None:
        answer["Access-Control-Allow-Headers"] = asked
    if headers.get("Access-Control-Request-Private-Network") is not None:
        failures.append("private-network")
    return Response(
        "Disallowed CORS " + ", ".join(failures),
        status=400,
        content_type="text/plain; charset=utf-8",
        headers=answer,
    )


async def vary_origin(answer: Response) -> Response:
    """``Vary: Origin`` on every other answer, as vLLM's CORS middleware adds
    it to every response of an origin it does not allow (any, by default),
    or of a request without one."""
    if answer.headers.get("Vary") == _PREFLIGHT_VARY:
        return answer
    answer.headers["Vary"] = ", ".join([*answer.headers.getlist("Vary"), "Origin"])
    return answer
