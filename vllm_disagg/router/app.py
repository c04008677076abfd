"""The router's HTTP front end (Quart): handlers parse, forward, and answer.

``create_app(config)`` builds everything one router runs (registry with the
static instances, policies, discovery listener, metrics, upstream client) and
ties their start and stop to the app's serving lifetime; ``serve(app)`` runs
it with uvicorn (or hypercorn, ``--http-server``) until a shutdown trigger
fires. Nothing is module-global:
several routers can live in one process (tests do).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from vllm_disagg import envs
from vllm_disagg.router import routes
from vllm_disagg.router.client_limits import ClientLimits, limited_protocol
from vllm_disagg.router.config import RouterConfig
from vllm_disagg.router.discovery import DiscoveryServer
from vllm_disagg.router.fleet_feed import FleetFeed
from vllm_disagg.router.metrics import CONTENT_TYPE, Outcome, RouterMetrics
from vllm_disagg.router.policy import Policies
from vllm_disagg.router.proxy import RequestProxy
from vllm_disagg.router.registry import InstanceRegistry
from vllm_disagg.router.replies import JSON
from vllm_disagg.wire.discovery import Role
from vllm_disagg.wire.logs import RateLimitedLog
from vllm_disagg.wire.peers import format_addr, is_loopback

logger = logging.getLogger(__name__)

STATE_KEY = "vllm_disagg_router"
SHUTDOWN_GRACE_S = 5.0
KEEP_ALIVE_S = 75  # above common client pools' idle times
FDS_PER_CONNECTION = 3  # a client connection, its prefill leg and its decode leg
FDS_RESERVED = 128  # listening sockets, discovery, logs, the interpreter's own


@dataclass
class RouterState:
    """What one router app runs; ``router_state(app)`` finds it."""

    config: RouterConfig
    registry: InstanceRegistry
    policies: Policies
    discovery: DiscoveryServer
    metrics: RouterMetrics
    proxy: RequestProxy
    http_port: int | None = None  # set by serve()
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set once serving


def router_state(app: Quart) -> RouterState:
    return app.extensions[STATE_KEY]


def build_registry(
    config: RouterConfig, clock: Callable[[], float] = time.monotonic
) -> InstanceRegistry:
    """A registry with the config's timeouts and its static instances."""
    registry = InstanceRegistry(
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        stall_timeout_s=config.stall_timeout_s,
        breaker_failures=config.breaker_failures,
        breaker_cooldown_s=config.breaker_cooldown_s,
        clock=clock,
    )
    static = (
        (Role.PREFILL, config.static_prefill),
        (Role.DECODE, config.static_decode),
    )
    for role, instances in static:
        for instance in instances:
            registry.add_static(
                role, instance.http_addr, instance.kv_addr, instance.model
            )
    return registry


def _json(payload: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(payload), status=status, content_type=JSON)


def create_app(
    config: RouterConfig,
    registry: InstanceRegistry | None = None,
    policies: Policies | None = None,
    *,
    feed: str | None = None,
    metrics_dir: str | None = None,
) -> Quart:
    """The router app. ``feed``: a ``--workers`` worker's (``workers.py``):
    the fleet comes from the supervisor's feed at that endpoint instead of a
    discovery port of its own; ``metrics_dir``: where the workers' metrics
    files are summed from."""
    registry = build_registry(config) if registry is None else registry
    policies = Policies.from_config(config) if policies is None else policies
    discovery_options = {
        "token": config.token,
        "allow_remote_unsigned": config.insecure_discovery,
        "loopback_only": config.credentials.local,
    }
    discovery: DiscoveryServer
    if feed is None:
        discovery = DiscoveryServer(
            registry,
            host=config.discovery_host,
            port=config.discovery_port,
            **discovery_options,
        )
    else:
        discovery = FleetFeed(
            registry,
            feed=feed,
            host=config.discovery_host,
            port=config.discovery_port,
            **discovery_options,
        )
    metrics = RouterMetrics(registry, discovery, multiprocess_dir=metrics_dir)
    proxy = RequestProxy(config, registry, policies, metrics)
    state = RouterState(config, registry, policies, discovery, metrics, proxy)

    app = Quart(__name__)
    # No redirects: werkzeug would answer a path with "//" with a 308 to a
    # Location built from the client's Host; vLLM's FastAPI answers 404.
    app.url_map.merge_slashes = False
    app.url_map.strict_slashes = True
    app.url_map.redirect_defaults = False
    app.config.update(
        MAX_CONTENT_LENGTH=config.max_body_bytes,
        # Above the connection's own body deadline (client_limits.py), which
        # drops the connection; Quart's answers 408 and keeps it open.
        BODY_TIMEOUT=config.client_body_timeout_s + 5.0,
        RESPONSE_TIMEOUT=None,  # the router's own deadlines end responses
        # OPTIONS is a method like any other, as in vLLM's FastAPI app (405).
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    app.extensions[STATE_KEY] = state

    @app.before_serving
    async def start() -> None:
        await proxy.start()
        state.ready.set()
        logger.info(
            "router: HTTP on http://%s discovery on %s (handoff %s, policies "
            "prefill=%s decode=%s)",
            format_addr(config.host, state.http_port),
            discovery.endpoint,
            config.handoff,
            config.policy_prefill,
            config.policy_decode,
        )
        credentials = config.credentials
        if credentials.local:
            logger.info(
                "router: no token given (--registration-token or %s): using %s; "
                "registrations are accepted from this user's processes on loopback "
                "only",
                envs.VLLM_DISAGG_ROUTER_TOKEN,
                credentials.source,
            )
        elif credentials.token is not None:
            logger.info("router: token from %s", credentials.source)
        else:
            logger.warning(
                "router: no registration token (--registration-token or %s)%s: "
                "registrations are not authenticated, and the router cannot sign the "
                "peers it names, so instances without allowed_peers compute every "
                "request locally",
                envs.VLLM_DISAGG_ROUTER_TOKEN,
                f" and {credentials.cookie_problem}"
                if credentials.cookie_problem
                else "",
            )

    @app.after_serving
    async def stop() -> None:
        await proxy.close()

    app.before_request(routes.preflight)
    app.after_request(routes.vary_origin)
    routes.register(app, state)

    @app.get("/v1/models")
    async def models() -> Response:
        return routes.response(
            await proxy.list_models(request.headers.get("Authorization"))
        )

    @app.get("/health")
    async def health() -> Response:
        prefill = len(registry.healthy(Role.PREFILL))
        decode = len(registry.healthy(Role.DECODE))
        ready = prefill > 0 and decode > 0
        return _json(
            {
                "status": "ready" if ready else "unavailable",
                "prefill": prefill,
                "decode": decode,
            },
            200 if ready else 503,
        )

    @app.get("/instances")
    async def instances() -> Response:
        # The fleet's addresses and state: for the router's own host only.
        if not is_loopback(request.remote_addr or ""):
            return _json({"detail": "Forbidden"}, 403)
        return _json(registry.snapshot())

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), content_type=CONTENT_TYPE)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        # As vLLM's FastAPI app answers an unknown path or method.
        return _json({"detail": error.name}, error.code or 500)

    unexpected_log = RateLimitedLog(logger)

    @app.errorhandler(Exception)
    async def unexpected(error: Exception) -> Response:
        # A bug, but one a client may be able to trigger at will: counted,
        # and its traceback logged at most once per interval.
        metrics.requests.labels(request.path, Outcome.ROUTER_ERROR).inc()
        unexpected_log.warning(
            "unexpected", "router: unexpected error on %s", request.path, exc_info=error
        )
        return routes.error(500, f"router error: {type(error).__name__}")

    return app


def client_limits(state: RouterState) -> ClientLimits:
    config = state.config
    closed = state.metrics.client_connections_closed
    return ClientLimits(
        max_connections=config.max_connections,
        max_header_bytes=config.max_header_bytes,
        header_timeout_s=config.client_header_timeout_s,
        idle_timeout_s=config.client_idle_timeout_s,
        body_timeout_s=config.client_body_timeout_s,
        on_closed=lambda reason: closed.labels(reason).inc(),
    )


def ensure_file_descriptors(max_connections: int) -> None:
    """Raise the soft file-descriptor limit to what ``max_connections``
    clients and their upstream legs need (up to the hard limit); warn once
    when even the hard limit is short, naming the flag."""
    needed = max_connections * FDS_PER_CONNECTION + FDS_RESERVED
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        logger.warning(
            "router: the file-descriptor limit (%d) is below what --max-connections %d "
            "needs (%d): lower --max-connections or raise the limit (ulimit -n)",
            soft,
            max_connections,
            needed,
        )


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)


async def serve(
    app: Quart,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Serve ``app`` (from create_app) until ``shutdown_trigger`` returns.

    Both ports are bound here, before the ASGI server runs: ``--port 0``
    works, ``router_state(app).http_port`` holds the port before ``ready`` is
    set, and a port in use raises its own OSError or ZMQError to the caller
    (the ASGI servers would wrap it in a lifespan failure and a traceback).
    ``sock``: a listening socket to serve instead (a ``--workers`` worker's,
    shared with the others).
    """
    state = router_state(app)
    ensure_file_descriptors(state.config.max_connections)
    if sock is None:
        sock = listen(state.config.host, state.config.port)
    state.http_port = sock.getsockname()[1]
    try:
        await state.discovery.start()
    except BaseException:
        sock.close()
        raise
    if shutdown_trigger is None:
        shutdown_trigger = asyncio.Event().wait  # until cancelled
    try:
        if state.config.http_server == "hypercorn":
            await _serve_hypercorn(app, sock, shutdown_trigger)
        else:
            await _serve_uvicorn(app, sock, shutdown_trigger)
    finally:
        await state.discovery.close()


async def _serve_uvicorn(
    app: Quart, sock: socket.socket, shutdown_trigger: Callable[[], Awaitable[None]]
) -> None:
    import uvicorn

    state = router_state(app)
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_config=None,
        access_log=False,
        http=limited_protocol(client_limits(state)),
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S),
        backlog=1024,
        # The router is the proxy: the peer is the client, whatever a
        # loopback client's X-Forwarded-For says (the legs get it appended).
        proxy_headers=False,
    )
    server = uvicorn.Server(config)

    async def stop_on_trigger() -> None:
        await shutdown_trigger()
        server.should_exit = True

    # The app's start and stop run here, not through ASGI lifespan events, so
    # a start-up error (the discovery port in use) reaches the caller as
    # itself instead of uvicorn's "Application startup failed" and exit(3).
    try:
        await app.startup()
    except BaseException:
        sock.close()
        raise
    watcher = asyncio.create_task(stop_on_trigger())
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        sock.close()
        await app.shutdown()


async def _serve_hypercorn(
    app: Quart, sock: socket.socket, shutdown_trigger: Callable[[], Awaitable[None]]
) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config as HypercornConfig

    hypercorn = HypercornConfig()
    hypercorn.bind = [f"fd://{sock.detach()}"]  # hypercorn owns and closes it
    hypercorn.accesslog = None
    hypercorn.errorlog = logging.getLogger("hypercorn.error")
    hypercorn.graceful_timeout = SHUTDOWN_GRACE_S
    hypercorn.keep_alive_timeout = KEEP_ALIVE_S
    # hypercorn's h11 bounds a request's head itself (431); it has no
    # connection cap nor a separate header deadline: read_timeout covers both
    # slow heads and slow bodies.
    config = router_state(app).config
    hypercorn.h11_max_incomplete_size = config.max_header_bytes
    hypercorn.read_timeout = int(max(1, config.client_idle_timeout_s))
    await hypercorn_serve(app, hypercorn, shutdown_trigger=shutdown_trigger)
