"""Every route of the installed vLLM's HTTP server is answered by the router
or listed, with the reason, in docs/router.md's table of vLLM's routes.

vLLM's routes come from vLLM itself: its ``build_app`` (what ``vllm serve``
builds before it starts an engine; no engine here) for a generating model,
with the dev-mode, tokenizer-info, fault-tolerance and scale-out routes on and
speech-to-text tasks, plus the pooling models' routers read from their
modules (vLLM adds them only with a pooling model's config). Imports vLLM:
some 20 s on an idle 2-core machine.
"""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest
from werkzeug.exceptions import MethodNotAllowed, NotFound

from vllm_disagg.router.app import create_app
from vllm_disagg.router.routes import (
    DECODE_ALONE,
    GENERATIONS,
    NO_KV_TRANSFER_PARAMS,
)

from .conftest import FAST

DOC = Path(__file__).parents[2] / "docs" / "router.md"
TABLE_TITLE = "### vLLM's routes"
POOLING_ROUTERS = ("pooling", "classify", "embed", "scoring")


def _routes_of(routes) -> dict[tuple[str, str], object]:
    """(method, path) -> vLLM's route object."""
    found = {}
    for route in routes:
        path = getattr(route, "path", None)
        if path is None:
            continue
        methods = getattr(route, "methods", None)
        if methods is None:  # a mount (/metrics) or a websocket
            methods = {"GET"} if type(route).__name__ == "Mount" else {"WEBSOCKET"}
        found.update(((m, path), route) for m in methods if m != "HEAD")
    return found


def _request_model(route) -> type | None:
    body = getattr(route, "body_field", None)
    annotation = getattr(getattr(body, "field_info", None), "annotation", None)
    return annotation if isinstance(annotation, type) else None


@pytest.fixture(scope="module")
def vllm_routes() -> dict[tuple[str, str], object]:
    launchers = pytest.importorskip("vllm.entrypoints.launchers.app")
    cli_args = pytest.importorskip("vllm.entrypoints.launchers.cli_args")
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")
        env.setenv("VLLM_ENABLE_COHERE_API", "1")
        parser = cli_args.make_arg_parser(argparse_utils.FlexibleArgumentParser())
        args = parser.parse_args(
            [
                "--model",
                "m",
                "--enable-tokenizer-info-endpoint",
                "--enable-fault-tolerance",
                "--enable-scale-out",  # the real routes, not their 403 stand-ins
            ]
        )
        # build_app sets the root logger to ERROR; later tests in this
        # process count warnings of loggers that inherit the root's level.
        root_level = logging.getLogger().level
        try:
            app = launchers.build_app(args, ("generate", "transcription", "realtime"))
        finally:
            logging.getLogger().setLevel(root_level)
    routes = _routes_of(app.routes)
    for name in POOLING_ROUTERS:
        module = importlib.import_module(f"vllm.entrypoints.pooling.{name}.api_router")
        routes |= _routes_of(module.router.routes)
    return routes


def documented() -> dict[tuple[str, str], str]:
    """(method, path) -> the router's answer, from the doc's table."""
    text = DOC.read_text()
    assert TABLE_TITLE in text, f"{DOC} has no {TABLE_TITLE!r} table"
    table = text.split(TABLE_TITLE, 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        assert cells[2], f"no reason given: {line}"
        for method, path in re.findall(r"`([A-Z]+) (/[^`]*)`", cells[0]):
            rows[(method, path)] = cells[1]
    return rows


def served(app, method: str, path: str) -> bool:
    adapter = app.url_map.bind("localhost")
    try:
        adapter.match(path.replace("{response_id}", "resp_1"), method)
    except (NotFound, MethodNotAllowed):
        return False
    return True


def test_every_vllm_route_is_served_or_documented(vllm_routes):
    app = create_app(FAST)
    table = documented()
    missing = sorted(r for r in vllm_routes if r not in table)
    assert not missing, f"vLLM routes missing from {DOC}'s table: {missing}"
    for (method, path), answer in sorted(table.items()):
        is_served = method != "WEBSOCKET" and served(app, method, path)
        assert is_served is (not answer.lower().startswith("not served")), (
            method,
            path,
            answer,
        )


def test_disaggregated_exactly_where_vllms_request_model_takes_kv_params(
    vllm_routes,
):
    """A generation gets a prefill leg where vLLM's request model for it
    carries ``kv_transfer_params`` (/invocations takes a chat or a
    completion body: both do), and only there."""
    assert set(GENERATIONS) <= {path for _, path in vllm_routes} | {
        "/cohere/v2/chat"  # only with VLLM_ENABLE_COHERE_API and cohere installed
    }
    for (method, path), route in vllm_routes.items():
        model = _request_model(route)
        takes_params = model is not None and "kv_transfer_params" in getattr(
            model, "model_fields", {}
        )
        if path == "/invocations":
            takes_params = True  # dispatched to the chat or completion model
        if path in GENERATIONS:
            assert takes_params, (path, model)
        elif path in DECODE_ALONE and DECODE_ALONE[path][1] == NO_KV_TRANSFER_PARAMS:
            assert not takes_params, (path, model)
