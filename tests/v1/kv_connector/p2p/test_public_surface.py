"""The P2P packages' public surfaces, their import cost, and vLLM's role names."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest
from vllm.config.kv_transfer import KVConsumer, KVProducer, KVRole

from vllm_disagg.distributed.kv_transfer.kv_connector.v1 import p2p
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import engine, roles


@pytest.mark.parametrize("package", [p2p, engine], ids=["p2p", "p2p.engine"])
def test_every_public_name_resolves_to_the_package(package):
    assert package.__all__ == sorted(set(package.__all__))
    for name in package.__all__:
        assert getattr(package, name).__module__.startswith(package.__name__ + "."), (
            name
        )
    assert set(package.__all__) <= set(dir(package))


def test_importing_the_package_or_its_options_stays_cheap():
    """A fresh interpreter: the package imports nothing of vLLM, and its options
    module neither the connector nor the engine (no import circle either)."""
    code = (
        "import sys\n"
        "import vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p as p2p\n"
        "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'vllm "
        "imported'\n"
        "import vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.config\n"
        "heavy = [m for m in sys.modules if m.startswith(p2p.__name__ + '.')\n"
        "         and m.split('.')[-1] in ('connector', 'engine', 'scheduler', "
        "'worker')]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_role_names_are_vllms():
    assert set(roles.KV_ROLES) == set(get_args(KVRole)) and len(roles.KV_ROLES) == 3
    assert {roles.KV_PRODUCER, roles.KV_BOTH} == set(get_args(KVProducer))
    assert {roles.KV_CONSUMER, roles.KV_BOTH} == set(get_args(KVConsumer))
