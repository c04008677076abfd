"""A whole disaggregated fleet on loopback, for chaos and soak runs.

:class:`Fleet` starts a router, ``N`` prefill instances and one decode
instance of ``dp_size`` DP ranks (one ``vllm serve`` per rank, external load
balancing, step sync between the ranks), every instance registering itself
with the router over discovery; the P2P connector moves KV over the ``tcp``
transport. Optionally a colocated reference server (the same model and
arguments, no connector) for the greedy outputs everything is compared with.

Every process is started in a process group of its own and stopped by its
PID (SIGTERM, then SIGKILL to its group); a stopped (SIGSTOP) group is
resumed before that. Faults are methods: :meth:`Fleet.kill` (SIGKILL a
member's group), :meth:`Fleet.kill_engine_core` (SIGKILL only the engine-core
child of a DP rank), :meth:`Fleet.pause` / :meth:`Fleet.resume`
(SIGSTOP/SIGCONT), :meth:`Fleet.restart` (a member, on the same ports) and
:meth:`Fleet.restart_router` (same HTTP and discovery ports).

:func:`probe_tree` reads RSS, threads and open file descriptors of a process
and all its descendants (engine cores are children of ``vllm serve``), for
the "memory, threads and fds stay flat" checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import requests

from vllm_disagg import envs
from vllm_disagg.testing.migration import engine_cores
from vllm_disagg.testing.p2p import free_kv_port, kv_transfer_config
from vllm_disagg.testing.router import RouterProcess
from vllm_disagg.testing.server import VllmServer, cpu_test_env, get_free_port

# Small, deterministic, eager float32: DP=2 greedy output equals DP=1's.
SERVER_ARGS = (
    "--max-model-len",
    "512",
    "--max-num-seqs",
    "16",
    "--seed",
    "0",
    "--dtype",
    "float32",
    "--block-size",
    "32",
    "--enforce-eager",
)


@dataclass
class FleetConfig:
    model: str
    log_dir: Path
    prefills: int = 2
    decode_dp: int = 2
    reference: bool = True
    # Connector options of every instance (kv_connector_extra_config).
    kv_load_timeout_s: float = 10.0
    kv_hold_timeout_s: float = 15.0
    # Step sync between the decode's DP ranks.
    step_sync_peer_timeout_s: float = 10.0
    # The router's failure handling (see docs/router.md, Flags).
    router_args: tuple[str, ...] = (
        "--heartbeat-timeout-s",
        "10",
        "--prefill-timeout-s",
        "10",
        "--first-token-timeout-s",
        "60",
        "--chunk-timeout-s",
        "30",
        "--request-timeout-s",
        "90",
    )
    server_args: tuple[str, ...] = SERVER_ARGS
    startup_timeout_s: float = 420.0
    # The P2P plane's shared secret, as a production fleet sets it: frames
    # from strangers (the hostile scenario) fail authentication.
    p2p_secret: str = "chaos-fleet-p2p-secret"
    # OpenMP as vLLM sets it by default (a pinned team per worker, all on the
    # same cores), not the harness's one unpinned thread per server.
    vllm_omp_defaults: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "prefills": self.prefills,
            "decode_dp": self.decode_dp,
            "kv_load_timeout_s": self.kv_load_timeout_s,
            "kv_hold_timeout_s": self.kv_hold_timeout_s,
            "step_sync_peer_timeout_s": self.step_sync_peer_timeout_s,
            "router_args": list(self.router_args),
            "server_args": list(self.server_args),
            "transport": "tcp",
            "send_type": "PUT_ASYNC",
            "openmp": "vLLM defaults"
            if self.vllm_omp_defaults
            else "1 unpinned thread",
        }


@dataclass
class Member:
    """One `vllm serve` of the fleet: a prefill, or one DP rank of the decode."""

    name: str  # "p1", "p2", "d0", "d1", "ref"
    role: str  # "prefill", "decode", "reference"
    server: VllmServer
    kv_port: int | None = None
    restarts: int = 0

    @property
    def kv_addr(self) -> str | None:
        return None if self.kv_port is None else f"127.0.0.1:{self.kv_port}"

    @property
    def http_addr(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def pid(self) -> int | None:
        proc = self.server.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def alive(self) -> bool:
        return self.pid is not None


# --- process probes ----------------------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    pid: int
    name: str
    rss: int  # bytes
    threads: int
    fds: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "name": self.name,
            "rss": self.rss,
            "threads": self.threads,
            "fds": self.fds,
        }


def _short_name(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
    except (psutil.Error, OSError):
        cmdline = []
    # vLLM retitles its processes ("VLLM::EngineCore_DP1"); else the script.
    if cmdline and cmdline[0].startswith("VLLM::"):
        return cmdline[0].split()[0]
    for arg in cmdline[1:3]:
        if arg in ("serve", "-m", "-c"):
            continue
        return os.path.basename(arg)[:40]
    try:
        return proc.name()
    except psutil.Error:
        return "?"


def probe_tree(pid: int) -> list[ProcStat]:
    """RSS, thread count and open fds of ``pid`` and every descendant (read
    from /proc); processes that vanish while read are left out."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    stats = []
    for proc in procs:
        try:
            with proc.oneshot():
                stats.append(
                    ProcStat(
                        proc.pid,
                        _short_name(proc),
                        proc.memory_info().rss,
                        proc.num_threads(),
                        proc.num_fds(),
                    )
                )
        except (psutil.Error, OSError):
            continue
    return stats


# --- the fleet ---------------------------------------------------------------


# What first_errors picks: errors, step sync's failures, a dead engine; not the
# rejections the hostile scenario causes on purpose.
_ERROR_LINE = re.compile(
    r"\bERROR\b|Traceback|StepSyncFailure|EngineDeadError|exited unexpectedly"
)
_NOISE_LINE = re.compile(r"reject|unauthenticated|malformed|Invalid HTTP request")
_LOG_TIME = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def _log_time(line: str) -> str:
    """VLLM's ``MM-DD hh:mm:ss`` or the router's ``YYYY-MM-DD hh:mm:ss``, as
    ``MM-DD hh:mm:ss`` for sorting; '~' (last) without one."""
    found = _LOG_TIME.search(line)
    return found.group(1)[-14:] if found else "~"


class FleetError(RuntimeError):
    pass


class Fleet:
    """Router + prefills + a DP decode (+ a colocated reference), on loopback."""

    def __init__(self, config: FleetConfig):
        self.config = config
        self.log_dir = Path(config.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.model = str(config.model)
        self.env = cpu_test_env(
            vllm_omp_defaults=config.vllm_omp_defaults,
            **{envs.VLLM_DISAGG_P2P_SECRET: config.p2p_secret},
        )
        self.router: RouterProcess | None = None
        self.old_routers: list[RouterProcess] = []
        self.members: dict[str, Member] = {}
        self.events: list[tuple[float, str]] = []  # (time.monotonic(), what)
        self._paused: set[str] = set()
        self.gauge_flushes: list[dict[str, Any]] = []

    # --- start / stop --------------------------------------------------------

    def _log(self, name: str, restarts: int = 0) -> Path:
        suffix = f".restart{restarts}" if restarts else ""
        return self.log_dir / f"{name}{suffix}.log"

    def note(self, what: str) -> float:
        now = time.monotonic()
        self.events.append((now, what))
        return now

    def _instance_args(
        self, role: str, kv_port: int, http_port: int, dp: tuple[int, int] | None
    ) -> list[str]:
        assert self.router is not None
        extra: dict[str, Any] = {
            "proxy_ip": "127.0.0.1",
            "proxy_port": str(self.router.discovery_port),
            "http_port": str(http_port),
            "transport": "tcp",
            "kv_hold_timeout_s": self.config.kv_hold_timeout_s,
        }
        if role == "kv_consumer":
            extra["kv_load_timeout_s"] = self.config.kv_load_timeout_s
        args = [
            *self.config.server_args,
            "--kv-transfer-config",
            kv_transfer_config(role, kv_port, **extra),
        ]
        if dp is not None:
            rank, rpc_port = dp
            options = {"step_sync_peer_timeout_s": self.config.step_sync_peer_timeout_s}
            args += [
                "--data-parallel-size",
                str(self.config.decode_dp),
                "--data-parallel-rank",
                str(rank),
                "--data-parallel-address",
                "127.0.0.1",
                "--data-parallel-rpc-port",
                str(rpc_port),
                "--additional-config",
                json.dumps(options),
            ]
        return args

    def _server(self, name: str, args: list[str], port: int) -> VllmServer:
        return VllmServer(
            self.model,
            args,
            log_path=self._log(name),
            env=self.env,
            port=port,
            startup_timeout_s=self.config.startup_timeout_s,
        )

    def start(self) -> Fleet:
        """Start everything at once; return when every server answers /health
        and the router lists every prefill and every decode rank."""
        started = time.monotonic()
        self.router = RouterProcess(
            list(self.config.router_args),
            log_path=self._log("router"),
            model=self.model,
            env=self.env,
        ).start()
        for i in range(1, self.config.prefills + 1):
            kv_port, http_port = free_kv_port(), get_free_port()
            args = self._instance_args("kv_producer", kv_port, http_port, None)
            self.members[f"p{i}"] = Member(
                f"p{i}", "prefill", self._server(f"p{i}", args, http_port), kv_port
            )
        kv_port, rpc_port = free_kv_port(max(4, self.config.decode_dp)), get_free_port()
        for rank in range(self.config.decode_dp):
            http_port = get_free_port()
            args = self._instance_args(
                "kv_consumer", kv_port, http_port, (rank, rpc_port)
            )
            self.members[f"d{rank}"] = Member(
                f"d{rank}",
                "decode",
                self._server(f"d{rank}", args, http_port),
                kv_port + rank,
            )
        if self.config.reference:
            port = get_free_port()
            self.members["ref"] = Member(
                "ref",
                "reference",
                self._server("ref", list(self.config.server_args), port),
            )
        try:
            for member in self.members.values():
                member.server.launch()
            for member in self.members.values():
                member.server.wait_ready()
            self.wait_registered(timeout_s=60)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        self.note("fleet ready")
        return self

    def stop(self) -> None:
        """Stop every process this fleet started, by PID; resume paused ones first."""
        for name in list(self._paused):
            self.resume(name)
        members = list(self.members.values())
        with ThreadPoolExecutor(max(1, len(members))) as pool:
            list(pool.map(lambda m: m.server.stop(), members))
        for router in [self.router, *self.old_routers]:
            if router is not None:
                router.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- views ---------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    def prefills(self) -> list[Member]:
        return [m for m in self.members.values() if m.role == "prefill"]

    def decodes(self) -> list[Member]:
        return [m for m in self.members.values() if m.role == "decode"]

    def serving(self) -> list[Member]:
        """Prefills and decode ranks (not the reference)."""
        return [m for m in self.members.values() if m.role != "reference"]

    def instances(self) -> list[dict[str, Any]]:
        assert self.router is not None
        return self.router.instances()

    def registered(self) -> set[str]:
        """Names of the members the router lists now."""
        by_addr = {m.http_addr: m.name for m in self.serving()}
        try:
            found = self.instances()
        except requests.RequestException:
            return set()
        return {by_addr[i["http_addr"]] for i in found if i["http_addr"] in by_addr}

    def wait_registered(
        self,
        names: Iterable[str] | None = None,
        *,
        timeout_s: float,
        absent: Iterable[str] = (),
    ) -> float:
        """Wait until the router lists ``names`` (default: every serving
        member) and none of ``absent``; the seconds it took."""
        want = set(names) if names is not None else {m.name for m in self.serving()}
        gone = set(absent)
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            now = self.registered()
            if want <= now and not (gone & now):
                return time.monotonic() - started
            if time.monotonic() > deadline:
                raise FleetError(
                    f"router lists {sorted(now)}; wanted {sorted(want)}"
                    f"{f' without {sorted(gone)}' if gone else ''}"
                    f" within {timeout_s:.0f}s"
                )
            time.sleep(0.2)

    def probes(self) -> dict[str, list[ProcStat]]:
        """Process stats of every live member and of the router, by member name."""
        out: dict[str, list[ProcStat]] = {}
        if (
            self.router is not None
            and self.router.proc
            and self.router.proc.poll() is None
        ):
            out["router"] = probe_tree(self.router.proc.pid)
        for m in self.members.values():
            if m.pid is not None:
                out[m.name] = probe_tree(m.pid)
        return out

    def metrics(self, name: str, prefix: str = "vllm:") -> dict[str, dict[str, float]]:
        """A member's (or ``"router"``'s) /metrics lines starting with ``prefix``."""
        if name == "router":
            assert self.router is not None
            text = requests.get(f"{self.router.url}/metrics", timeout=10).text
            found: dict[str, dict[str, float]] = {}
            for line in text.splitlines():
                if line.startswith(prefix):
                    name_labels, _, value = line.rpartition(" ")
                    metric, _, labels = name_labels.partition("{")
                    found.setdefault(metric, {})[labels.rstrip("}")] = float(value)
            return found
        return self.members[name].server.metrics(prefix=prefix)

    def metric_sum(self, name: str, metric: str) -> float:
        """Sum over labels of ``metric`` (or ``metric_total``) on member ``name``."""
        values = self.metrics(name, prefix=metric)
        return sum(
            v
            for m, labels in values.items()
            if m in (metric, f"{metric}_total")
            for v in labels.values()
        )

    def log_tails(self, lines: int = 80) -> list[tuple[str, str]]:
        """(title, tail) of every log this fleet wrote, restarts included."""
        out = []
        for path in sorted(self.log_dir.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append((path.name, "\n".join(text)))
        return out

    def first_errors(self, limit: int = 3) -> str:
        """The first error line of each log that has one (at most ``limit``
        logs, earliest first): a failed chaos test's message leads with it,
        so a CI summary that shows one line still names what broke first."""
        found = []
        for path in sorted(self.log_dir.glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if _ERROR_LINE.search(line) and not _NOISE_LINE.search(line):
                    found.append(f"{path.stem}: {line.strip()[:240]}")
                    break
        if not found:
            return "no error line in any log"
        return " | ".join(sorted(found, key=_log_time)[:limit])

    # --- faults --------------------------------------------------------------

    def kill(self, name: str) -> float:
        """SIGKILL a member's whole process group (``"router"`` too); the time."""
        if name == "router":
            assert self.router is not None
            self.router.kill()
        else:
            self.members[name].server.kill()
        return self.note(f"kill -9 {name}")

    def kill_engine_core(self, name: str) -> float:
        """SIGKILL only the engine-core child of member ``name`` (one DP rank's
        engine)."""
        pid = self.members[name].pid
        cores = engine_cores(pid) if pid else []
        if len(cores) != 1:
            raise FleetError(f"{name}: expected one engine-core child, found {cores}")
        cores[0].kill()
        return self.note(f"kill -9 {name} engine core (pid {cores[0].pid})")

    def pause(self, name: str) -> float:
        pid = self.members[name].pid
        if pid is None:
            raise FleetError(f"{name} is not running")
        os.killpg(pid, signal.SIGSTOP)
        self._paused.add(name)
        return self.note(f"SIGSTOP {name}")

    def resume(self, name: str) -> float:
        pid = self.members[name].pid
        if pid is not None:
            os.killpg(pid, signal.SIGCONT)
        self._paused.discard(name)
        return self.note(f"SIGCONT {name}")

    def restart(self, names: Iterable[str], *, wait: bool = True) -> float:
        """Start members again on their ports (stopping what is left of them
        first); with ``wait``, until /health answers. The time of the launch."""
        names = list(names)
        for name in names:
            member = self.members[name]
            member.server.stop()
            member.restarts += 1
            member.server.log_path = self._log(name, member.restarts)
        at = self.note(f"restart {','.join(names)}")
        for name in names:
            self.members[name].server.launch()
        if wait:
            for name in names:
                self.members[name].server.wait_ready()
        return at

    def restart_router(self) -> float:
        """Start a new router on the killed one's HTTP and discovery ports."""
        old = self.router
        assert old is not None
        self.old_routers.append(old)
        at = self.note("restart router")
        self.router = RouterProcess(
            list(self.config.router_args),
            log_path=self._log("router", len(self.old_routers)),
            model=self.model,
            env=self.env,
            port=old.port,
            discovery_port=old.discovery_port,
        ).start()
        return at

    def wait_dead(self, names: Iterable[str], *, timeout_s: float) -> dict[str, float]:
        """Wait until the top process of each member has exited; when each did
        (time.monotonic()); members still alive at the deadline are left out."""
        pending = {n: self.members[n] for n in names}
        died: dict[str, float] = {}
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for name, m in list(pending.items()):
                if m.server.proc is None or m.server.proc.poll() is not None:
                    died[name] = time.monotonic()
                    del pending[name]
            time.sleep(0.1)
        return died

    # --- quiescence ----------------------------------------------------------

    def load(self) -> dict[str, dict[str, float]]:
        """What is still held: per live serving member, running and waiting
        requests, KV cache use, P2P receive buffer and host pool bytes; the
        router's outstanding requests per instance."""
        out: dict[str, dict[str, float]] = {}
        for m in self.serving():
            if m.pid is None or m.name in self._paused:
                continue
            try:
                values = m.server.metrics(prefix="vllm:")
            except requests.RequestException:
                continue

            def total(metric: str, values: dict = values) -> float:
                return sum(
                    v
                    for name, labels in values.items()
                    if name in (metric, f"{metric}_total")
                    for v in labels.values()
                )

            out[m.name] = {
                "running": total("vllm:num_requests_running"),
                "waiting": total("vllm:num_requests_waiting"),
                "kv_cache_usage": total("vllm:kv_cache_usage_perc"),
                "p2p_buffer_bytes": max(0.0, total("vllm:p2p_buffer_bytes")),
                "p2p_pool_bytes": max(0.0, total("vllm:p2p_pool_bytes")),
            }
        try:
            outstanding = {i["http_addr"]: i["outstanding"] for i in self.instances()}
        except requests.RequestException:
            outstanding = {}
        out["router"] = {"outstanding": float(sum(outstanding.values()))}
        return out

    def wait_quiet(
        self, *, timeout_s: float, flush_every_s: float = 5.0
    ) -> tuple[bool, dict[str, dict[str, float]]]:
        """Wait until nothing is held anywhere (see :meth:`load`); (quiet, last load).

        The P2P gauges reach /metrics only with an engine step: KV that the
        connector frees while its engine is idle (the sweeper freeing KV no
        request claimed, after ``kv_hold_timeout_s``) leaves the last value
        on /metrics. So while no request is in flight anywhere and a gauge is
        not 0, one tiny local request (no peers) is sent straight to that
        member every ``flush_every_s``, and its next reading is a fresh one.
        Each such reading is noted in :attr:`gauge_flushes`.
        """
        deadline = time.monotonic() + timeout_s
        last_flush: dict[str, float] = {}
        while True:
            load = self.load()
            quiet = all(v == 0 for member in load.values() for v in member.values())
            if quiet or time.monotonic() > deadline:
                return quiet, load
            idle = all(
                v.get("running", 0) == 0
                and v.get("waiting", 0) == 0
                and v.get("outstanding", 0) == 0
                for v in load.values()
            )
            if idle:
                for name, values in load.items():
                    held = values.get("p2p_buffer_bytes", 0) + values.get(
                        "p2p_pool_bytes", 0
                    )
                    if (
                        held
                        and time.monotonic() - last_flush.get(name, 0.0)
                        >= flush_every_s
                    ):
                        last_flush[name] = time.monotonic()
                        self.gauge_flushes.append(
                            {
                                "t": time.monotonic(),
                                "member": name,
                                "before": dict(values),
                            }
                        )
                        self.flush(name)
            time.sleep(0.5)

    def flush(self, name: str) -> None:
        """One token of a tiny prompt, straight to member ``name`` with no
        peers named (computed there): its engine steps and ships fresh stats."""
        with contextlib.suppress(requests.RequestException):
            requests.post(
                f"{self.members[name].server.url}/v1/completions",
                timeout=30,
                json={"model": self.model, "prompt": [1, 2, 3], "max_tokens": 1},
            )


def instance_summary(fleet: Fleet) -> dict[str, Any]:
    """Who is registered, who is alive: for reports."""
    return {
        "registered": sorted(fleet.registered()),
        "alive": sorted(m.name for m in fleet.members.values() if m.alive()),
    }


__all__ = [
    "Fleet",
    "FleetConfig",
    "FleetError",
    "Member",
    "ProcStat",
    "SERVER_ARGS",
    "instance_summary",
    "probe_tree",
]
