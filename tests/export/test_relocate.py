"""The relocation rules on small inputs, the refusal, and the real p2p slice."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

pytest.importorskip("libcst")

from vllm_disagg.export import layout as L  # noqa: E402
from vllm_disagg.export import relocate as R  # noqa: E402
from vllm_disagg.export.source import ExportError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
P2P_FILE = "vllm_disagg/distributed/kv_transfer/kv_connector/v1/p2p/config.py"


@pytest.fixture(scope="module")
def modules() -> R.ModuleMap:
    return R.ModuleMap(R.plan(ROOT))


def _job(modules: R.ModuleMap, source: str) -> R.FileJob:
    return modules.by_source[source]


def _rewrite(
    modules, code: str, source: str = P2P_FILE, **changes
) -> tuple[str, list[str]]:
    job = dataclasses.replace(_job(modules, source), **changes)
    text, problems, _ = R.rewrite_file(code, job, modules, job.slice)
    return text, problems


def test_imports_module_by_module_and_name_by_name(modules):
    text, problems = _rewrite(
        modules,
        "from vllm_disagg.wire.peers import format_addr, split_addr\n"
        "from vllm_disagg.wire import grants\n"
        "from vllm_disagg.distributed.kv_transfer.kv_connector.v1 import p2p\n"
        "from vllm_disagg.logger import init_logger\n"
        "from . import roles\n"
        "from .transport.base import Endpoint  # noqa: F401\n",
    )
    assert problems == []
    assert "from vllm.distributed.wire.peers import format_addr, split_addr\n" in text
    assert "from vllm.distributed.wire import grants\n" in text
    assert "from vllm.distributed.kv_transfer.kv_connector.v1 import p2p\n" in text
    assert "from vllm.logger import init_logger\n" in text
    assert (
        "from vllm.distributed.kv_transfer.kv_connector.v1.p2p import roles\n" in text
    )
    # A statement's own comment (a noqa) stays with it.
    assert (
        "from vllm.distributed.kv_transfer.kv_connector.v1.p2p.transport.base import "
        "Endpoint  # noqa: F401\n"
    ) in text


def test_config_error_becomes_value_error_everywhere(modules):
    text, problems = _rewrite(
        modules,
        "from vllm_disagg.errors import ConfigError\n"
        "def f():\n    raise ConfigError('x')\n"
        "try:\n    f()\nexcept ConfigError:\n    pass\n",
    )
    assert problems == []
    assert "ConfigError" not in text and "import" not in text
    assert "raise ValueError('x')" in text and "except ValueError:" in text


def test_env_constants_accessors_and_fstrings(modules):
    text, problems = _rewrite(
        modules,
        "from vllm_disagg import envs\n"
        "secret = envs.p2p_secret()\n"
        "host = envs.serve_host()\n"
        'msg = f"set {envs.VLLM_DISAGG_P2P_SECRET} (or '
        '{envs.VLLM_DISAGG_P2P_SECRET_FILE})"\n'
        "log(envs.VLLM_DISAGG_ROUTER_TOKEN)\n"
        "# VLLM_DISAGG_SERVE_PORT: see above\n",
    )
    assert problems == []
    assert text.count("import vllm.envs as envs\n") == 1
    assert "secret = envs.VLLM_P2P_NCCL_SECRET\n" in text
    assert "host = envs.VLLM_P2P_NCCL_SERVE_HOST\n" in text
    assert 'msg = f"set VLLM_P2P_NCCL_SECRET (or VLLM_P2P_NCCL_SECRET_FILE)"' in text
    assert 'log("VLLM_P2P_NCCL_ROUTER_TOKEN")' in text
    assert "# VLLM_P2P_NCCL_SERVE_PORT: see above" in text


def test_env_import_goes_when_only_names_were_used(modules):
    text, problems = _rewrite(
        modules, "from vllm_disagg import envs\nNAME = envs.VLLM_DISAGG_ROUTER_TOKEN\n"
    )
    assert problems == [] and "vllm.envs" not in text
    assert 'NAME = "VLLM_P2P_NCCL_ROUTER_TOKEN"' in text


def test_an_env_accessor_without_an_in_tree_form_refuses(modules):
    _, problems = _rewrite(
        modules, "from vllm_disagg import envs\nx = envs.metrics_dir()\n"
    )
    assert len(problems) == 1 and "metrics_dir has no in-tree form" in problems[0]
    assert problems[0].startswith(f"{P2P_FILE}:2: ")


def test_strings_docstrings_comments_and_metric_prefix(modules):
    text, problems = _rewrite(
        modules,
        '"""See ``vllm_disagg/wire/peers.py`` and :mod:`vllm_disagg.wire.frames`."""\n'
        'PREFIX = "vllm_disagg:p2p_"\n'
        'LABEL = b"vllm-disagg-discovery"\n'
        "TARGET = "
        '"vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config.P2pConfig"\n'
        "# from vllm_disagg.testing.server.VllmServer\n",
    )
    assert problems == []
    assert "``vllm/distributed/wire/peers.py``" in text
    assert ":mod:`vllm.distributed.wire.frames`" in text
    assert 'PREFIX = "vllm:p2p_"' in text
    assert 'LABEL = b"vllm-p2p-nccl-discovery"' in text
    assert '"vllm.distributed.kv_transfer.kv_connector.v1.p2p.config.P2pConfig"' in text
    assert "# from tests.v1.kv_connector.p2p_utils.server.VllmServer" in text


def test_forbidden_imports_get_upstreams_replacements(modules):
    text, problems = _rewrite(modules, "import re\nimport base64, os\n")
    assert problems == []
    assert "import regex as re\n" in text and "import pybase64 as base64\n" in text
    assert "import os\n" in text


@pytest.mark.parametrize(
    ("code", "what"),
    [
        (
            "from vllm_disagg.patches import PATCHES\n",
            "vllm_disagg.patches: the patch registry",
        ),
        ("from vllm_disagg.errors import VllmDisaggError\n", "vllm_disagg.errors"),
        ("import vllm_disagg.plugin as plugin\n", "vllm_disagg.plugin"),
        ('"""See vllm_disagg.diagnostics."""\n', "vllm_disagg.diagnostics"),
        ("x = 'VLLM_DISAGG_DISABLE'\n", "VLLM_DISAGG_DISABLE has no in-tree name"),
        ("x = 'Vllm-Disagg rules'\n", "still names the project"),
        ("from vllm_disagg.router.config import RouterConfig\n", "later slice"),
    ],
)
def test_unresolved_references_are_reported_with_file_and_line(modules, code, what):
    _, problems = _rewrite(modules, "import os\n\n" + code)
    assert problems and what in problems[0], problems
    assert problems[0].split(":")[1] in ("3", "4"), problems[0]


def test_relocate_refuses_in_one_line(tmp_path, monkeypatch):
    pkg = tmp_path / "vllm_disagg" / "wire"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Wire."""\n')
    (pkg / "peers.py").write_text(
        "import os\n\nfrom vllm_disagg.entrypoints import x\n"
    )
    monkeypatch.setattr(
        L,
        "MOVES",
        (
            L.Move(
                "vllm_disagg.wire",
                "vllm.distributed.wire",
                "vllm/distributed/wire",
                "p2p",
            ),
        ),
    )
    monkeypatch.setattr(L, "HELPERS", {})
    monkeypatch.setattr(L, "TESTS", ())
    monkeypatch.setattr(L, "CONFTESTS", ())
    with pytest.raises(ExportError) as info:
        R.relocate(tmp_path, "p2p", format=False)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("p2p: unresolved: vllm_disagg/wire/peers.py:3: ")
    assert "vllm_disagg.entrypoints" in message
    (pkg / "peers.py").write_text("import os\n")
    relocation = R.relocate(tmp_path, "p2p", format=False)
    assert set(relocation.files) == {
        "vllm/distributed/wire/__init__.py",
        "vllm/distributed/wire/peers.py",
    }
    assert all(text.startswith(R.SPDX) for text in relocation.files.values())


def test_unit_tests_get_the_cpu_marker_and_lose_the_project_ones(modules):
    source = "tests/v1/kv_connector/p2p/test_codec.py"
    text, problems = _rewrite(
        modules, "import pytest\n\npytestmark = pytest.mark.e2e\n", source=source
    )
    assert problems == [] and "pytestmark = pytest.mark.cpu_test\n" in text
    text, _ = _rewrite(
        modules,
        "import pytest\n\npytestmark = [pytest.mark.slow_test]\n",
        source=source,
    )
    assert "pytestmark = [pytest.mark.slow_test, pytest.mark.cpu_test]" in text
    text, _ = _rewrite(modules, '"""Doc."""\n\nimport os\n', source=source)
    assert "import pytest\n" in text and "pytestmark = pytest.mark.cpu_test" in text
    # The CPU end-to-end tests are selected by the marker too (the router's
    # by a line of their own in the same job).
    e2e = "tests/v1/kv_connector/p2p/test_p2p_get_put_e2e.py"
    text, _ = _rewrite(
        modules, "import pytest\n\npytestmark = pytest.mark.e2e\n", source=e2e
    )
    assert "pytestmark = pytest.mark.cpu_test\n" in text
    routed = "tests/v1/kv_connector/p2p/test_p2p_e2e.py"
    text, _ = _rewrite(
        modules, "import pytest\n\npytestmark = pytest.mark.e2e\n", source=routed
    )
    assert "pytestmark = pytest.mark.cpu_test\n" in text
    # A marker selects nothing in a conftest.py, an __init__.py or a helper.
    for other in ("conftest.py", "__init__.py", "e2e_common.py"):
        text, _ = _rewrite(
            modules,
            "import pytest\n\npytestmark = pytest.mark.e2e\n",
            source=f"tests/v1/kv_connector/p2p/{other}",
        )
        assert "pytestmark" not in text, other


def test_sibling_tests_import_each_other_relatively(modules):
    source = "tests/v1/kv_connector/p2p/test_engine_safety.py"
    text, problems = _rewrite(
        modules,
        "from .test_engine import deadline  # noqa: F401\n"
        "from vllm_disagg.testing.scheduler import tokens\n",
        source=source,
    )
    assert problems == []
    assert "from .test_engine import deadline  # noqa: F401\n" in text
    assert "from tests.v1.kv_connector.p2p_utils.scheduler import tokens\n" in text


def test_noop_calls_go_and_other_uses_refuse(modules):
    source = "vllm_disagg/testing/scheduler.py"
    code = (
        "from vllm_disagg.distributed.kv_transfer import register_connectors\n"
        "def f():\n    register_connectors()\n    return 1\n"
    )
    text, problems = _rewrite(modules, code, source=source)
    assert problems == [] and "register_connectors" not in text
    _, problems = _rewrite(modules, code + "g = register_connectors\n", source=source)
    assert len(problems) == 1 and "register_connectors" in problems[0]


ENVS = """\
import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    VLLM_HOST_IP: str = ""


def maybe_convert_int(value):
    return None if value is None else int(value)


environment_variables: dict[str, Callable[[], Any]] = {
    # Where this node is.
    "VLLM_HOST_IP": lambda: os.getenv("VLLM_HOST_IP", ""),
}
"""


def test_env_vars_are_declared_in_envs_py(monkeypatch):
    text = R.add_env_vars(ENVS, L.ENV_VARS)
    namespace: dict = {}
    exec(compile(text, "envs.py", "exec"), namespace)
    table = namespace["environment_variables"]
    assert list(table)[1:] == [v.name for v in L.ENV_VARS]
    monkeypatch.setenv("VLLM_P2P_NCCL_SECRET", "s")
    monkeypatch.setenv("VLLM_P2P_NCCL_SERVE_PORT", "8001")
    assert table["VLLM_P2P_NCCL_SECRET"]() == b"s"
    assert table["VLLM_P2P_NCCL_SERVE_PORT"]() == 8001
    assert table["VLLM_P2P_NCCL_ROUTER_TOKEN"]() is None
    assert "    VLLM_P2P_NCCL_SECRET: bytes | None = None\n" in text
    with pytest.raises(ExportError, match="already declares VLLM_P2P_NCCL_SECRET"):
        R.add_env_vars(text, L.ENV_VARS)
    with pytest.raises(ExportError, match="TYPE_CHECKING.*found 0 times"):
        R.add_env_vars(ENVS.replace("if TYPE_CHECKING:", "if False:"), L.ENV_VARS)
    twice = ENVS + "environment_variables = {}\n"
    with pytest.raises(ExportError, match="environment_variables.*found 2 times"):
        R.add_env_vars(twice, L.ENV_VARS)


@pytest.mark.skipif(
    shutil.which("ruff") is None
    and not (Path(__import__("sys").executable).parent / "ruff").exists(),
    reason="ruff is not installed",
)
def test_the_p2p_slice_names_nothing_of_the_project():
    relocation = R.relocate(ROOT, "p2p")
    files = relocation.files
    assert "vllm/distributed/kv_transfer/kv_connector/v1/p2p/connector.py" in files
    assert "vllm/distributed/wire/peers.py" in files
    assert "tests/v1/kv_connector/unit/p2p/test_config.py" in files
    for path, text in files.items():
        assert text.startswith(R.SPDX), path
        assert not R.LEFTOVER.search(text), path
        if path.startswith("tests/v1/kv_connector/unit/"):
            # A conftest's pytestmark would mark nothing: only test modules.
            helper = path.endswith(("__init__.py", "conftest.py"))
            assert "pytest.mark.cpu_test" in text or helper, path
    assert {v.name for v in relocation.env_vars} >= {"VLLM_P2P_NCCL_SECRET"}
    assert not any(path.startswith("examples/") for path in files)
