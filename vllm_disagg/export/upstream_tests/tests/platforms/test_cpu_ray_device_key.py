"""The CPU platform names the Ray resource its devices are counted under.

``vllm serve --data-parallel-backend ray`` builds each DP rank's placement
group from ``current_platform.ray_device_key``; an empty key stops it with
"No  found in Ray cluster".
"""

import pytest

from vllm.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.cpu_test


def test_cpu_ray_device_key_is_cpu():
    assert CpuPlatform.ray_device_key == "CPU"
    assert CpuPlatform().ray_device_key == "CPU"
