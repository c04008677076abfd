"""The host spellings every component compares: one function each, in wire/peers.py."""

from vllm_disagg.wire.peers import (
    canonical_addr,
    canonical_host,
    is_loopback,
    source_host,
)


def test_one_spelling_per_host():
    assert canonical_host("[0:0:0:0:0:0:0:1]") == canonical_host("::1") == "::1"
    assert canonical_host("Decode-1.Example.") == "decode-1.example"
    assert canonical_addr("[0:0::1]:5") == (canonical_host("::1"), 5)


def test_source_host_unwraps_ipv4_seen_through_a_dual_stack_socket():
    assert source_host("::ffff:127.0.0.1") == "127.0.0.1"
    assert source_host("0:0:0:0:0:0:0:1") == "::1"
    assert source_host("") is None and source_host(None) is None


def test_loopback():
    assert (
        is_loopback("127.0.0.1") and is_loopback("[::1]") and is_loopback("LOCALHOST.")
    )
    assert not is_loopback("10.0.0.1") and not is_loopback("decode-1.example")
