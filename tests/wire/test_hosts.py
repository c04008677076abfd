"""The host spellings every component compares: one function each, in
wire/peers.py; and the one ``host:port`` grammar discovery, the router and
the P2P plane share."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_disagg.wire.discovery import (
    DISCOVERY_VERSION,
    DiscoveryError,
    Register,
    Role,
    validate,
)
from vllm_disagg.wire.grants import check_grant, make_grant
from vllm_disagg.wire.peers import (
    PeerInfoError,
    canonical_addr,
    canonical_host,
    is_loopback,
    make_kv_transfer_params,
    parse_peer_info,
    source_host,
    split_addr,
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


# --- one grammar: what discovery accepts, the router and the P2P plane accept --

_OTHER = "10.0.0.2:22001"


def _discovery_accepts(addr: str) -> bool:
    try:
        validate(
            Register(DISCOVERY_VERSION, "i", Role.PREFILL, addr, addr, "m", sent_at=1.0)
        )
    except DiscoveryError:
        return False
    return True


def _router_names(addr: str) -> None:
    """What the router does with a registered kv_addr for every request it
    pairs (router/proxy.py name_peers), and what an instance does with it."""
    params = make_kv_transfer_params(addr, _OTHER, "k1")
    grant = make_grant(b"t", addr, _OTHER, "k1")
    peer = parse_peer_info("any-id", params)
    check_grant(b"t", grant, peer)


@pytest.mark.parametrize(
    "addr",
    [
        "999.1.1.1:80",
        "1.2.3:80",
        "127.0.0.1:80\n",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        "127.0.0.1:099999",
        "::1:80",
        "[::1]:80\n",
        "[1.2.3.4]:80",
        "-a.example:80",
        "a..example:80",
        "a_b:80",
        "a" * 64 + ":80",  # a label is at most 63 characters
        " 10.0.0.1:80",
        "10.0.0.1: 80",
    ],
)
def test_discovery_refuses_what_the_grammar_refuses(addr):
    assert not _discovery_accepts(addr)
    with pytest.raises(PeerInfoError):
        split_addr(addr)


@pytest.mark.parametrize(
    "addr",
    [
        "[::1]:80",
        "[0:0:0:0:0:0:0:1]:1",
        "[fe80::1]:65535",
        "127.0.0.1:80",
        "localhost:8000",
        "decode-1.example:22001",
        "Decode-1.EXAMPLE:22001",
        "a" * 63 + ".b:80",
        "x1:80",
    ],
)
def test_what_discovery_accepts_the_router_can_name(addr):
    assert _discovery_accepts(addr)
    _router_names(addr)


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="0123456789abcdefABCDEF.:-_[]\n x", max_size=24)
    | st.from_regex(
        r"\A(\[[0-9a-f:.]{2,12}\]|[0-9.]{1,15}|[a-z0-9.-]{1,12}):[0-9]{1,6}\Z"
    )
)
def test_one_grammar_for_discovery_the_router_and_the_p2p_plane(addr):
    """Discovery accepts exactly what split_addr accepts, and everything it
    accepts, the router can put in a request and an instance can parse."""
    try:
        split_addr(addr)
        grammar = True
    except PeerInfoError:
        grammar = False
    assert _discovery_accepts(addr) is grammar
    if grammar:
        _router_names(addr)
