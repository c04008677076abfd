"""The router-example slice's wiring: the example found from the tests' own
location, async tests that run under upstream's strict pytest-asyncio, files
that replace an earlier commit's, and the CI line that runs them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_disagg.export import layout as L  # noqa: E402
from vllm_disagg.export import relocate as R  # noqa: E402
from vllm_disagg.export.overlay import prepare  # noqa: E402
from vllm_disagg.export.series import by_slug  # noqa: E402
from vllm_disagg.export.source import ExportError  # noqa: E402
from vllm_disagg.export.tree import Identity, add_files, git  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = next(m for m in L.MOVES if m.slice == "router-example")
HELPER = f"{L.HELPER_PACKAGE.replace('.', '/')}/router.py"
CONFTEST = f"{L.ROUTER_TESTS}/conftest.py"
_ME = Identity("Export Test", "export-test@example.com")


@pytest.fixture(scope="module")
def slice_files() -> R.Relocation:
    return R.relocate(ROOT, "router-example", format=False)


@pytest.fixture(scope="module")
def modules() -> R.ModuleMap:
    return R.ModuleMap(R.plan(ROOT))


def _rewrite(modules, code: str, source: str) -> str:
    job = modules.by_source[source]
    text, problems, _ = R.rewrite_file(code, job, modules, job.slice)
    assert problems == []
    return text


def _exec_module(text: str, path: Path) -> dict:
    """Run a relocated module's top-level code as if it were at ``path``."""
    namespace = {"__file__": str(path), "__name__": "relocated"}
    exec(compile(text, str(path), "exec"), namespace)
    return namespace


def test_the_helper_finds_the_example_from_its_own_location(slice_files, tmp_path):
    helper = slice_files.files[HELPER]
    # The definitions only (the module's imports name the tree's test packages).
    start = helper.index("ROUTER_EXAMPLE_DIR = (")
    end = helper.index("class RouterStartupError")
    code = "import os\nfrom pathlib import Path\n" + helper[start:end]
    ns = _exec_module(code, tmp_path / HELPER)
    example_dir = EXAMPLE.path.rsplit("/", 1)[0]
    assert ns["ROUTER_EXAMPLE_DIR"] == tmp_path / example_dir
    assert EXAMPLE.upstream == EXAMPLE.path.rsplit("/", 1)[1]  # python -m <it>
    env = {"PYTHONPATH": "/elsewhere"}
    assert ns["router_pythonpath"](env) == f"{tmp_path / example_dir}:/elsewhere"
    assert ns["router_pythonpath"]({}) == str(tmp_path / example_dir)
    # Every router the helper starts gets it, whatever env it was given.
    assert "router_pythonpath(self.env)" in helper
    assert '"-m",\n            "p2p_nccl_router",' in helper


def test_the_router_tests_put_the_example_on_sys_path_before_importing_it(
    slice_files,
):
    text = slice_files.files[CONFTEST]
    insert = text.index("sys.path.insert(0, str(ROUTER_EXAMPLE_DIR))")
    assert text.index("import ROUTER_EXAMPLE_DIR") < insert
    assert insert < text.index("from p2p_nccl_router.app import")
    # Routers the tests start as processes inherit it.
    assert 'monkeypatch.setenv("PYTHONPATH", router_pythonpath())' in text
    config = slice_files.files[f"{L.ROUTER_TESTS}/test_config.py"]
    assert "examples/online_serving" not in config
    assert '"-m",\n                "p2p_nccl_router",' in config


def test_no_exported_file_imports_a_project_test_module(slice_files):
    for path, text in slice_files.files.items():
        assert "tests.router" not in text, path
    limits = slice_files.files[f"{L.ROUTER_TESTS}/test_client_limits.py"]
    assert "from .conftest import WAIT_S" in limits


def test_async_tests_and_fixtures_run_under_strict_pytest_asyncio(modules):
    source = "tests/router/test_endpoints.py"
    text = _rewrite(
        modules,
        "import pytest\n\n\n"
        "@pytest.fixture\nasync def thing():\n    yield 1\n\n\n"
        "@pytest.fixture(scope='module')\nasync def other():\n    return 2\n\n\n"
        "@pytest.fixture\ndef plain():\n    return 3\n\n\n"
        "@pytest.mark.parametrize('x', [1])\nasync def test_a(x):\n    pass\n\n\n"
        "async def helper():\n    pass\n\n\n"
        "def test_sync():\n    pass\n",
        source,
    )
    assert "import pytest_asyncio\n" in text
    assert "@pytest_asyncio.fixture\nasync def thing" in text
    assert "@pytest_asyncio.fixture(scope='module')\nasync def other" in text
    assert "@pytest.fixture\ndef plain" in text
    assert (
        "@pytest.mark.parametrize('x', [1])\n@pytest.mark.asyncio\nasync def test_a"
    ) in text
    assert "@pytest.mark.asyncio\nasync def helper" not in text
    assert "@pytest.mark.asyncio\ndef test_sync" not in text
    # A module marked as a whole keeps its tests as they are.
    text = _rewrite(
        modules,
        "import pytest\n\npytestmark = pytest.mark.asyncio\n\n\n"
        "async def test_a():\n    pass\n",
        source,
    )
    assert "@pytest.mark.asyncio" not in text
    assert "pytestmark = [pytest.mark.asyncio, pytest.mark.cpu_test]" in text


def test_the_slice_replaces_the_integration_conftest_and_adds_nothing_twice(
    slice_files,
):
    integration = f"{L.INTEGRATION}/conftest.py"
    assert slice_files.replaces == (integration,)
    assert "def start_router" in slice_files.files[integration]
    # The p2p slice's package and variables are in the tree already.
    assert f"{L.INTEGRATION}/__init__.py" not in slice_files.files
    assert slice_files.env_vars == ()


def test_add_files_replaces_only_what_it_is_told_to(tmp_path):
    (tmp_path / "a.py").write_text("old\n")
    with pytest.raises(ExportError, match="overwrite an upstream file"):
        add_files(tmp_path, {"a.py": "new\n"})
    with pytest.raises(ExportError, match="nothing to replace"):
        add_files(tmp_path, {"b.py": "new\n"}, replaces=["b.py"])
    assert add_files(tmp_path, {"a.py": "new\n"}, replaces=["a.py"]) == ["a.py"]
    assert (tmp_path / "a.py").read_text() == "new\n"


def test_the_commit_runs_the_router_tests_in_a_cpu_job():
    commit = by_slug("p2p-nccl-router-example")
    assert commit.relocate == "router-example" and commit.ci_job is not None
    routed = {
        f"{L.INTEGRATION}/{n}"
        for n in (
            "test_p2p_e2e.py",
            "test_p2p_dp_e2e.py",
            "test_p2p_cpu_defaults_e2e.py",
        )
    }
    assert set(commit.ci_tests) == {L.ROUTER_TESTS, *routed}
    assert commit.ci_command().startswith("pytest -v -s -m 'cpu_test' ")
    # The -m cpu_test line selects them: every test module is marked.
    entries = [e for e in L.TESTS if e.slice == "router-example"]
    assert entries and all(e.unit for e in entries)
    # The P2P commit's line names its own file, not the directory the
    # router's end-to-end tests land in (they would run twice).
    assert L.INTEGRATION not in by_slug("p2p-nccl-connector").ci_tests


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_overlay_carries_the_examples_the_series_adds(tmp_path):
    fork, wheel = tmp_path / "fork", tmp_path / "wheel"
    (fork / "vllm").mkdir(parents=True)
    (fork / "tests").mkdir()
    (fork / "vllm" / "__init__.py").write_text("")
    (fork / "pyproject.toml").write_text("")
    git(fork, "init", "--quiet")
    git(fork, "add", "--all")
    git(fork, "commit", "--quiet", "-m", "base", identity=_ME)
    example = fork / "examples" / "x" / "pkg" / "__main__.py"
    example.parent.mkdir(parents=True)
    example.write_text("print('hi')\n")
    git(fork, "add", "--all")
    git(fork, "commit", "--quiet", "-m", "example", identity=_ME)
    shutil.copytree(fork / "vllm", wheel)
    overlay = prepare(fork, tmp_path / "overlay", wheel=wheel)
    copied = overlay.root / "examples" / "x" / "pkg" / "__main__.py"
    assert copied.read_text() == "print('hi')\n" and not copied.is_symlink()
    done = subprocess.run(
        [sys.executable, "-m", "pkg"],
        cwd=copied.parents[1],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout == "hi\n"
