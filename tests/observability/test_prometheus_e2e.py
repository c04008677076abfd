"""A real Prometheus scraping a real router in front of fake instances
(vllm_disagg.testing.fake_instance): the dashboard's router queries return
data, and when the only decode dies the matching alerts go pending.

The rules are observability/alerts.yml with every ``for:`` cut to 1 s and
evaluated every second. Needs the ``prometheus`` binary (Debian/Ubuntu:
``apt-get install -y prometheus``); skips, saying so, without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from tests.router.conftest import fakes, start_router  # noqa: F401 (fixtures)
from vllm_disagg.testing import prometheus as testing_prometheus
from vllm_disagg.testing.prometheus import dashboard_exprs
from vllm_disagg.wire.discovery import Role

pytestmark = pytest.mark.e2e

# panels whose queries must return data once requests have gone through
ROUTER_PANELS = {
    "Requests by outcome",
    "Requests by endpoint",
    "Instances by role",
    "Prefill leg: failures and retries",
    "Decode leg: retries and recomputes",
    "Removals, breakers, stalls",
    "Added latency (router)",
}
DEADLINE_S = 45


@pytest.fixture
def prometheus(tmp_path):
    """Factory: a Prometheus on a loopback port scraping ``targets`` (job ->
    host:port) every second with the fleet's rules, ``for:`` cut to 1 s."""
    if testing_prometheus.binary() is None:
        pytest.skip(testing_prometheus.SKIP_REASON)
    with contextlib.ExitStack() as stack:
        yield lambda targets: stack.enter_context(
            testing_prometheus.running(targets, tmp_path)
        )


async def query(client: aiohttp.ClientSession, url: str, expr: str) -> list:
    async with client.get(f"{url}/api/v1/query", params={"query": expr}) as resp:
        body = await resp.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


async def alerts(client: aiohttp.ClientSession, url: str) -> dict[str, str]:
    """The state (pending, firing) of each active alert, by name."""
    async with client.get(f"{url}/api/v1/alerts") as resp:
        body = await resp.json()
    return {a["labels"]["alertname"]: a["state"] for a in body["data"]["alerts"]}


async def eventually(check, what: str, deadline: float):
    last = None
    while time.monotonic() < deadline:
        try:
            last = await check()
            if last:
                return last
        except aiohttp.ClientError as e:
            last = e
        await asyncio.sleep(0.5)
    pytest.fail(f"{what}: not within {DEADLINE_S} s (last: {last!r})")


async def test_dashboard_has_data_and_a_dead_decode_raises_its_alerts(
    prometheus,
    start_router,  # noqa: F811
    fakes,  # noqa: F811
):
    deadline = time.monotonic() + DEADLINE_S
    router = await start_router()
    p, d = await fakes("p"), await fakes("d")
    router.add(p, Role.PREFILL)
    router.add(d, Role.DECODE)
    prom = prometheus({"vllm-disagg-router": f"127.0.0.1:{router.state.http_port}"})
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}

    async with aiohttp.ClientSession() as client:
        for _ in range(3):
            status, _, _ = await router.post("/v1/completions", body)
            assert status == 200
        # two scrapes with the requests counted, so that rate() has data
        await eventually(
            lambda: query(
                client,
                prom,
                "count_over_time(vllm_disagg_router_requests_total[1m]) > 1",
            ),
            "two scrapes of the router",
            deadline,
        )
        # every query is valid; each router panel shows something (a labelled
        # counter nothing has counted yet has no series: one query is enough)
        shown: set[str] = set()
        for title, expr in dashboard_exprs():
            result = await query(client, prom, expr.replace("$__rate_interval", "1m"))
            if result:
                shown.add(title)
        assert ROUTER_PANELS - shown == set()

        await d.stop()  # the only decode dies: refused, removed, then 503
        for _ in range(3):
            await router.post("/v1/completions", body)

        seen: list[dict[str, str]] = [{}]

        async def raised():
            # keep answering 503s: rate() needs the counter to rise between
            # scrapes (a labelled series' first value counts no increase)
            await router.post("/v1/completions", body)
            state = seen[0] = await alerts(client, prom)
            wanted = {
                "VllmDisaggRouterNoDecodeInstance",
                "VllmDisaggRouterAnswering503",
            }
            return state if wanted <= state.keys() else None

        try:
            state = await eventually(raised, "the dead decode's alerts", deadline)
        except pytest.fail.Exception as e:
            raise AssertionError(f"{e}; active alerts: {seen[0]}") from None
    assert state["VllmDisaggRouterNoDecodeInstance"] in ("pending", "firing")
    assert "VllmDisaggTargetDown" not in state  # the router itself is up
