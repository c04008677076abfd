"""Loggers that share vLLM's handlers and format.

vLLM configures only the ``vllm`` logger tree, so our loggers live under it
(``vllm.vllm_disagg.*``): their lines carry the same process prefix, e.g.
``(EngineCore_DP1 pid=123)``, and obey ``VLLM_LOGGING_LEVEL``.
"""

from vllm.logger import init_logger as _vllm_init_logger


def init_logger(name: str):
    return _vllm_init_logger(f"vllm.{name}")
