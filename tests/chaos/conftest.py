"""One fleet for the chaos module: started once, stopped by PID at the end;
a failing test's report gets the tail of every log the fleet wrote."""

from __future__ import annotations

import pytest

from vllm_disagg.testing.chaos import warm_up
from vllm_disagg.testing.fleet import Fleet, FleetConfig
from vllm_disagg.testing.traffic import compute_references, make_specs

SEED = 20261125
WARMUP = 16

_fleets: list[Fleet] = []


def _start(tiny_models, tmp_path_factory, name: str, **config):
    """Start a chaos fleet and warm it up; yields (fleet, references, specs).

    The colocated reference is prefill p2 asked with no peers named, before
    it takes part in any transfer (a plain ``vllm serve`` run of the same
    model and arguments, as in tests/v1/kv_connector/p2p/): a fifth server
    would cost this 2-core machine about 15 s of start-up and 3 GiB.
    ``benchmarks/chaos.py`` starts a separate reference server.
    """
    fleet = Fleet(
        FleetConfig(
            model=str(tiny_models["tiny-mixtral"]),
            reference=False,
            log_dir=tmp_path_factory.mktemp(name),
            **config,
        )
    )
    _fleets.append(fleet)
    try:
        fleet.start()
        warm_specs, mix = make_specs(SEED, fleet.model, count=WARMUP, start=10_000_000)
        specs, more = make_specs(SEED, fleet.model)
        mix.references.update(more.references)
        references = compute_references(fleet.members["p2"].server.url, mix)
        warm = warm_up(fleet, list(warm_specs), references)
        bad = [r for r in warm if r.outcome in ("failed", "wrong")]
        assert not bad, f"warm-up: {[r.as_dict() for r in bad]}"
        yield fleet, references, specs
    finally:
        fleet.stop()
        _fleets.remove(fleet)


@pytest.fixture(scope="module")
def chaos_fleet(tiny_models, tmp_path_factory):
    """(fleet, references, endless spec iterator): the fleet warmed up, every
    server with the harness's OpenMP setting (one unpinned thread)."""
    yield from _start(tiny_models, tmp_path_factory, "chaos-logs")


@pytest.fixture(scope="module")
def chaos_fleet_vllm_defaults(tiny_models, tmp_path_factory):
    """The same fleet with vLLM's own OpenMP defaults, as users start it:
    every worker pins a team to every core of this machine."""
    yield from _start(
        tiny_models, tmp_path_factory, "chaos-defaults-logs", vllm_omp_defaults=True
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for fleet in _fleets:
            for title, tail in fleet.log_tails(80):
                report.sections.append((f"chaos fleet log {title}", tail))
