"""On CPU, each DP rank started by the Ray DP backend runs its workers with the
mp executor: Ray's executor cannot start CPU workers."""

import pytest

from vllm.config import ParallelConfig, VllmConfig
from vllm.platforms import current_platform

pytestmark = [
    pytest.mark.cpu_test,
    pytest.mark.skipif(not current_platform.is_cpu(), reason="CPU platform only"),
]


def _executor_backend(**parallel_kwargs) -> str:
    vllm_config = VllmConfig(parallel_config=ParallelConfig(**parallel_kwargs))
    return vllm_config.parallel_config.distributed_executor_backend


def test_ray_dp_backend_uses_mp_executor():
    pytest.importorskip("ray")
    assert (
        ParallelConfig(
            data_parallel_size=2, data_parallel_backend="ray"
        ).distributed_executor_backend
        == "ray"
    )
    assert _executor_backend(data_parallel_size=2, data_parallel_backend="ray") == "mp"


def test_mp_dp_backend_is_unchanged():
    assert _executor_backend(data_parallel_size=2) == "mp"
    assert _executor_backend(
        data_parallel_size=2, distributed_executor_backend="mp"
    ) == ("mp")
