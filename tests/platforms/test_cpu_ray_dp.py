"""cpu-ray-dp: the CPU platform's Ray device key (an enabler), and the
executor backend startup-validation picks for the Ray DP backend on CPU.

The Ray DP server itself is tests/v1/distributed/test_step_sync_ray_dp.py;
the CLI message for an explicit Ray executor is in tests/entrypoints/test_cli.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.platforms import current_platform
from vllm.platforms.cpu import CpuPlatform

from vllm_disagg.errors import ConfigError
from vllm_disagg.patches import PATCHES
from vllm_disagg.patches.engine import arg_utils
from vllm_disagg.patches.platforms import cpu

BY_NAME = {p.name: p for p in PATCHES}


def test_registered_as_an_enabler_of_the_upstream_module():
    patch = BY_NAME["cpu-ray-dp"]
    assert patch.kind == "enabler"
    assert patch.module == cpu.__name__
    assert "RAY_OVERRIDE_RESOURCES" in patch.how and "mp" in patch.how


def test_apply_gives_cpu_the_ray_device_key(monkeypatch):
    monkeypatch.setattr(CpuPlatform, "ray_device_key", "")
    assert not cpu.is_applied()
    cpu.apply()
    assert cpu.is_applied()
    assert CpuPlatform.ray_device_key == "CPU"
    cpu.apply()  # idempotent
    assert CpuPlatform.ray_device_key == "CPU"
    if current_platform.is_cpu():
        # What create_dp_placement_groups looks up in each node's resources.
        assert current_platform.ray_device_key == "CPU"


def test_apply_keeps_a_key_upstream_set(monkeypatch):
    monkeypatch.setattr(CpuPlatform, "ray_device_key", "XYZ")
    cpu.apply()
    assert CpuPlatform.ray_device_key == "XYZ"
    assert not cpu.is_applied()


def _engine_args(executor, dp_backend="ray"):
    return SimpleNamespace(
        distributed_executor_backend=executor, data_parallel_backend=dp_backend
    )


class _RayExecutor:
    uses_ray = True


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)


def test_unset_executor_with_ray_dp_becomes_mp_on_cpu(on_cpu):
    args = _engine_args(None)
    arg_utils.check_cpu_executor_backend(args)
    assert args.distributed_executor_backend == "mp"


@pytest.mark.parametrize("executor", [None, "mp", "uni"])
def test_other_executors_are_left_alone(on_cpu, executor):
    args = _engine_args(executor, dp_backend="mp")
    arg_utils.check_cpu_executor_backend(args)
    assert args.distributed_executor_backend == executor
    args = _engine_args("mp")
    arg_utils.check_cpu_executor_backend(args)
    assert args.distributed_executor_backend == "mp"


@pytest.mark.parametrize("executor", ["ray", _RayExecutor], ids=["ray", "ray-class"])
@pytest.mark.parametrize("dp_backend", ["ray", "mp"])
def test_explicit_ray_executor_is_refused_on_cpu(on_cpu, executor, dp_backend):
    with pytest.raises(
        ConfigError,
        match=(
            r"--distributed-executor-backend ray "
            r".*use --distributed-executor-backend mp"
        ),
    ):
        arg_utils.check_cpu_executor_backend(_engine_args(executor, dp_backend))


def test_other_platforms_keep_upstream_defaults(monkeypatch):
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    for executor in (None, "ray"):
        args = _engine_args(executor)
        arg_utils.check_cpu_executor_backend(args)
        assert args.distributed_executor_backend == executor


def test_create_engine_config_resolves_the_executor_before_upstream(
    monkeypatch, on_cpu
):
    """The wrapper runs the check on the EngineArgs, where unset (None) still
    differs from upstream's default, before upstream's create_engine_config."""
    seen = []
    monkeypatch.setattr(
        arg_utils,
        "_upstream_create_engine_config",
        lambda self, *a, **k: seen.append(self.distributed_executor_backend)
        or SimpleNamespace(),
    )
    monkeypatch.setattr(arg_utils, "check_cpu_head_size", lambda config: None)
    monkeypatch.setattr(arg_utils, "_feature_config_checks", [])
    arg_utils.create_engine_config(_engine_args(None))
    assert seen == ["mp"]
    with pytest.raises(ConfigError):
        arg_utils.create_engine_config(_engine_args("ray"))
    assert seen == ["mp"]
