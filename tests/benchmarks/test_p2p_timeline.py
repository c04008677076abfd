"""The transfer benchmark's timeline (benchmarks/common/p2p_timeline.py): one
sample's stamps, from both processes, cut into phases at its milestones."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def timeline():
    path = ROOT / "benchmarks" / "common" / "p2p_timeline.py"
    spec = importlib.util.spec_from_file_location("p2p_timeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _get_sample():
    """A GET at t = 10.0: the decode's Get request (10.2-10.9) also ends after
    the prefill's Offer starts; the milestones must take the prefill's."""
    return [
        ("decode get job", 10.2, 10.95),
        ("decode control request", 10.2, 10.9),
        ("prefill on_get", 10.6, 10.65),
        ("prefill peer job", 10.7, 12.0),
        ("prefill control request", 10.71, 11.5),
        ("prefill channel.send", 11.6, 11.8),
        ("prefill channel.send", 11.8, 11.95),
        ("decode channel.recv", 11.2, 11.85),
        ("decode channel.recv", 11.85, 11.97),
    ]


def test_phases_follow_the_milestones_of_each_side_and_add_up(timeline):
    cut = timeline.phases("GET", _get_sample(), 10.0, 12.1)
    names = timeline.PHASES["GET"]
    assert len(cut) == len(names)
    got = dict(zip(names, (round(c, 3) for c in cut)))
    assert got["expect to the decode's peer thread"] == 0.2
    assert got["Get, one way"] == 0.4  # decode's request start to on_get
    assert got["Offer round trip"] == 0.79  # the prefill's request, not the decode's
    assert got["data on the wire"] == 0.37  # first send to the last receive's end
    assert got["last byte to poll()"] == 0.13
    assert sum(cut) == pytest.approx(2.1)


def test_a_sample_missing_a_milestone_is_left_out(timeline):
    stamps = [s for s in _get_sample() if s[0] != "prefill on_get"]
    assert timeline.phases("GET", stamps, 10.0, 12.1) is None
    # Stamps before the sample's start (the offer of PUT-after-pass) do not count.
    put = [
        ("prefill control request", 9.0, 9.5),
        ("prefill channel.send", 10.1, 10.3),
        ("decode channel.recv", 9.6, 10.35),
    ]
    assert [
        round(c, 3) for c in timeline.phases("PUT-after-pass", put, 10.0, 10.4)
    ] == [
        0.1,
        0.25,
        0.05,
    ]
    rows = timeline.rows({"PUT-after-pass": {4: [[0.1, 0.25, 0.05]]}}, [4, 16])
    assert ["PUT-after-pass", "data on the wire", "250.000", "-"] in rows
