"""Peer grants: what a router signs and an instance checks before acting on
the peers a request names."""

from __future__ import annotations

import pytest

from vllm_disagg.wire.grants import (
    MAX_GRANT_TTL_S,
    GrantError,
    check_grant,
    make_grant,
)
from vllm_disagg.wire.peers import PeerInfo, parse_peer_info

TOKEN = b"fleet-token"
P, D = "10.0.0.1:21001", "[::1]:22001"
NOW = 1_800_000_000.0


def peer(prefill: str = P, decode: str = D, key: str = "k1") -> PeerInfo:
    return parse_peer_info(
        "x",
        {
            "p2p_prefill_addr": prefill,
            "p2p_decode_addr": decode,
            "p2p_request_key": key,
        },
    )


def test_a_grant_verifies_for_its_peers_and_key_in_any_spelling():
    grant = make_grant(TOKEN, P, D, "k1", now=NOW)
    check_grant(TOKEN, grant, peer(), now=NOW + 1)
    check_grant(TOKEN, grant, peer(decode="[0:0:0:0:0:0:0:1]:22001"), now=NOW + 1)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(dict(key="k2"), id="another-key"),
        pytest.param(dict(decode="10.0.0.9:22001"), id="another-decode"),
        pytest.param(dict(prefill=D, decode=P), id="swapped"),
    ],
)
def test_a_grant_names_exactly_one_transfer(other):
    grant = make_grant(TOKEN, P, D, "k1", now=NOW)
    with pytest.raises(GrantError) as e:
        check_grant(TOKEN, grant, peer(**other), now=NOW)
    assert e.value.kind == "forged"


def test_another_token_expiry_and_garbage_are_refused():
    grant = make_grant(TOKEN, P, D, "k1", ttl_s=10, now=NOW)
    with pytest.raises(GrantError, match="^forged"):
        check_grant(b"guess", grant, peer(), now=NOW)
    with pytest.raises(GrantError, match="^expired"):
        check_grant(TOKEN, grant, peer(), now=NOW + 11)
    too_long = make_grant(TOKEN, P, D, "k1", ttl_s=MAX_GRANT_TTL_S + 60, now=NOW)
    with pytest.raises(GrantError, match="^malformed"):
        check_grant(TOKEN, too_long, peer(), now=NOW)
    for bad in (None, 5, "", "v1.1.zz", "v2." + grant[3:], grant + "0", "x" * 10_000):
        with pytest.raises(GrantError):
            check_grant(TOKEN, bad, peer(), now=NOW)
    # Changing the expiry breaks the MAC: a captured grant cannot be extended.
    version, expires, mac = grant.split(".")
    with pytest.raises(GrantError, match="^forged"):
        check_grant(TOKEN, f"{version}.{int(expires) + 3600}.{mac}", peer(), now=NOW)


def test_an_empty_token_makes_no_grant():
    with pytest.raises(ValueError):
        make_grant(b"", P, D, "k1")
