"""vllm_disagg: step-synchronized DP and P2P NCCL xPyD disaggregation for vLLM.

The package is a vLLM *general plugin*: vLLM calls :func:`register` in every
process it starts (API server, engine cores, workers). :func:`register` checks
the vLLM version and applies the patch set listed in
:mod:`vllm_disagg.patches` exactly once per process. It lives in
:mod:`vllm_disagg.plugin`, which this module imports on first use (as vLLM's
own ``__init__`` does with its public names), so importing the package, as the
router does, imports nothing of vLLM.
"""

__version__ = "0.1.0"

_PLUGIN_NAMES = (
    "SUPPORTED_VLLM_VERSION",
    "check_vllm_version",
    "load_patch_set",
    "register",
)


def __getattr__(name: str):
    if name in _PLUGIN_NAMES:
        from vllm_disagg import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__", *_PLUGIN_NAMES]
