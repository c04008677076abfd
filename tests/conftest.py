"""Shared fixtures: tiny models built once per session, real `vllm serve` servers.

End-to-end tests are marked ``e2e``; ``pytest -m "not e2e"`` runs the fast set.
When a test fails, the tail of every server log started for it is attached to
the report.
"""

from __future__ import annotations

import pytest

from vllm_disagg.testing.router import RouterProcess
from vllm_disagg.testing.server import VllmServer, cpu_test_env
from vllm_disagg.testing.tiny_models import build_all


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked full (the long chaos scenarios and "
        "comparisons CI leaves out to stay within its budget) and the full "
        "overlay check",
    )
    parser.addoption(
        "--rewrite-transcripts",
        action="store_true",
        help="tests/transcripts: write what the protocol cores produce now into "
        "the transcript files instead of comparing (review the diff)",
    )
    parser.addoption(
        "--full-overlay",
        action="store_true",
        help="tests/export/test_fork.py: run every relocated unit test on the "
        "in-tree overlay (CI collects them only; about 10 min more on 2 cores)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="a long test CI leaves out: run with --full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


# Servers and routers whose log tails a failing test's report gets.
_live_servers: list[VllmServer | RouterProcess] = []


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict:
    """Paths of the tiny checkpoints: {"tiny-llama": Path, "tiny-mixtral": Path}."""
    return build_all(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """Factory: (model, args, name=..., **env) -> running VllmServer.

    Servers are stopped at the end of the session, or earlier via .stop().
    With ``wait=False`` the server is only launched; call ``.wait_ready()``.
    """
    log_dir = tmp_path_factory.mktemp("server-logs")
    started: list[VllmServer] = []

    def start(
        model,
        args=(),
        *,
        name: str,
        wait: bool = True,
        port: int | None = None,
        **env: str,
    ) -> VllmServer:
        server = VllmServer(
            model,
            list(args),
            log_path=log_dir / f"{name}.log",
            env=cpu_test_env(**env),
            port=port,
        )
        started.append(server)
        _live_servers.append(server)
        return server.start() if wait else server.launch()

    yield start
    for server in started:
        server.stop()
        _live_servers.remove(server)


@pytest.fixture(scope="session")
def start_router(tmp_path_factory):
    """Factory: (name=..., model=..., args=[...]) -> running RouterProcess
    (``python -m vllm_disagg.router`` on free loopback ports); stopped at the
    end of the session or earlier via .stop()."""
    log_dir = tmp_path_factory.mktemp("router-logs")
    started: list[RouterProcess] = []

    def start(*, name: str, model: str = "", args=()) -> RouterProcess:
        router = RouterProcess(
            list(args), log_path=log_dir / f"{name}.log", model=model
        )
        started.append(router)
        _live_servers.append(router)
        return router.start()

    yield start
    for router in started:
        router.stop()
        _live_servers.remove(router)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in _live_servers:
            report.sections.append(
                (f"server log {server.log_path.name}", server.log_tail(120))
            )
