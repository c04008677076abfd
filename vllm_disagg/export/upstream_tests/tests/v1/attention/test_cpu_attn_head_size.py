"""The CPU attention backend refuses a head size its kernels do not support
when the attention layer is built, naming the supported sizes."""

import pytest

from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)

pytestmark = pytest.mark.cpu_test


def _impl(head_size: int) -> CPUAttentionBackendImpl:
    return CPUAttentionBackendImpl(
        num_heads=4,
        head_size=head_size,
        scale=head_size**-0.5,
        num_kv_heads=4,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
    )


@pytest.mark.parametrize("head_size", [16, 40])
def test_unsupported_head_size_is_refused(head_size: int):
    supported = CPUAttentionBackend.get_supported_head_sizes()
    assert head_size not in supported
    with pytest.raises(ValueError, match=f"Head size {head_size} is not supported"):
        _impl(head_size)
    with pytest.raises(ValueError, match=str(supported).replace("[", r"\[")):
        _impl(head_size)


@pytest.mark.parametrize("head_size", [48, 80, 112, 128])
def test_head_sizes_of_the_kernels_are_supported(head_size: int):
    # 48, 80 and 112 run on the VEC16 kernels, the others on every ISA.
    assert CPUAttentionBackend.supports_head_size(head_size)
