"""How a request names its P2P peers: kv_transfer_params or the seed's request
id, found inside the ids vLLM really produces, with bounded grammars that
never run across fields and errors that are always PeerInfoError."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    PROTOCOL_VERSION,
)
from vllm_disagg.wire.peers import (
    DECODE_ADDR_KEY,
    DECODE_MARKER,
    MAX_KEY_CHARS,
    PEER_INFO_KEYS,
    PREFILL_ADDR_KEY,
    PREFILL_MARKER,
    REQUEST_KEY_KEY,
    PeerInfo,
    PeerInfoError,
    format_addr,
    make_kv_transfer_params,
    make_request_id,
    parse_peer_info,
    split_addr,
)

KEY = "0123456789abcdef0123456789abcdef"
ADDRS = [
    ("10.0.0.1:21001", "10.0.0.2:22001", ("10.0.0.1", 21001, "10.0.0.2", 22001)),
    (
        "prefill-0.svc.local:21001",
        "decode-1:22001",
        ("prefill-0.svc.local", 21001, "decode-1", 22001),
    ),
    ("[::1]:21001", "[2001:db8::2]:22001", ("::1", 21001, "2001:db8::2", 22001)),
]


def test_protocol_version_and_keys():
    assert PROTOCOL_VERSION == 4
    assert PEER_INFO_KEYS == (PREFILL_ADDR_KEY, DECODE_ADDR_KEY, REQUEST_KEY_KEY)
    assert len(set(PEER_INFO_KEYS)) == 3


@pytest.mark.parametrize(
    "prefill, decode, fields", ADDRS, ids=["ipv4", "hostname", "ipv6"]
)
def test_round_trips(prefill, decode, fields):
    request_id = make_request_id(prefill, decode, KEY)
    assert request_id == f"___prefill_addr_{prefill}___decode_addr_{decode}_{KEY}"
    expected = PeerInfo(*fields, KEY)
    assert parse_peer_info(request_id, None) == expected
    assert (expected.prefill_addr, expected.decode_addr) == (prefill, decode)
    params = make_kv_transfer_params(prefill, decode, KEY)
    assert params == {
        PREFILL_ADDR_KEY: prefill,
        DECODE_ADDR_KEY: decode,
        REQUEST_KEY_KEY: KEY,
    }
    assert parse_peer_info("cmpl-unrelated-0-af5c0d3e", params) == expected
    assert expected.to_kv_transfer_params() == params


@pytest.mark.parametrize(
    "wrap",
    [
        "{}",  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, or the proxy's own view
        "cmpl-{}-0-af5c0d3e",  # completions
        "chatcmpl-{}-1a2b3c4d",  # chat
        "1_cmpl-{}-0-af5c0d3e",  # n > 1 child
        "12_chatcmpl-{}-deadbeef",
        "{}_extra_suffix",
    ],
)
def test_ids_vllm_produces(wrap):
    proxy_id = make_request_id("10.0.0.1:21001", "[::1]:22001", "abc123")
    peer = parse_peer_info(wrap.format(proxy_id), None)
    assert peer == PeerInfo("10.0.0.1", 21001, "::1", 22001, "abc123")


def test_default_key_is_a_fresh_uuid_hex():
    first = parse_peer_info(make_request_id("h:1", "h:2"), None)
    second = parse_peer_info(make_request_id("h:1", "h:2"), None)
    assert len(first.key) == 32 and first.key != second.key
    int(first.key, 16)


def test_params_win_over_the_id():
    request_id = make_request_id("10.0.0.1:21001", "10.0.0.2:22001", "fromid")
    params = {
        **make_kv_transfer_params("10.9.9.9:1", "10.8.8.8:2", "fromparams"),
        "x": 1,
    }
    peer = parse_peer_info(request_id, params)
    assert (peer.prefill_addr, peer.decode_addr, peer.key) == (
        "10.9.9.9:1",
        "10.8.8.8:2",
        "fromparams",
    )
    # Other params (prompt_token_ids, ...) do not count as naming peers.
    assert parse_peer_info(request_id, {"prompt_token_ids": [1, 2]}).key == "fromid"
    assert parse_peer_info(request_id, ["not", "a", "dict"]).key == "fromid"


@pytest.mark.parametrize("missing", PEER_INFO_KEYS)
def test_incomplete_params_are_an_error_naming_the_key(missing):
    params = make_kv_transfer_params("10.0.0.1:21001", "10.0.0.2:22001", KEY)
    del params[missing]
    request_id = make_request_id("10.0.0.1:21001", "10.0.0.2:22001", KEY)
    with pytest.raises(PeerInfoError, match=f"kv_transfer_params.{missing}: missing"):
        parse_peer_info(request_id, params)


@pytest.mark.parametrize(
    "key, value",
    [
        (PREFILL_ADDR_KEY, "::1:21001"),  # IPv6 must be bracketed
        (PREFILL_ADDR_KEY, "10.0.0.1"),
        (DECODE_ADDR_KEY, "10.0.0.2:0"),
        (DECODE_ADDR_KEY, "10.0.0.2:65536"),
        (DECODE_ADDR_KEY, 22001),
        (DECODE_ADDR_KEY, "under_score:1"),
        (REQUEST_KEY_KEY, "has-dash"),
        (REQUEST_KEY_KEY, ""),
        (REQUEST_KEY_KEY, "k" * 129),
        (REQUEST_KEY_KEY, None),
    ],
)
def test_bad_params_name_the_key(key, value):
    params = {
        **make_kv_transfer_params("10.0.0.1:21001", "10.0.0.2:22001", KEY),
        key: value,
    }
    with pytest.raises(PeerInfoError, match=f"^kv_transfer_params.{key}: ") as info:
        parse_peer_info("plain", params)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "request_id",
    [
        "",
        "cmpl-abc-0-af5c0d3e",
        "chatcmpl-7f3e",
        "prefill_addr_10.0.0.1:1",
        "__prefill_addr_x",
    ],
)
def test_ordinary_requests_name_no_peers(request_id):
    assert parse_peer_info(request_id, None) is None
    assert parse_peer_info(request_id, {}) is None


@pytest.mark.parametrize(
    "request_id",
    [
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001",  # no key
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_",
        "___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_k.y",
        "___prefill_addr_::1:21001___decode_addr_10.0.0.2:22001_k",  # bare IPv6
        "___prefill_addr_[::g]:21001___decode_addr_10.0.0.2:22001_k",
        "___prefill_addr_10.0.0.1:0___decode_addr_10.0.0.2:22001_k",
        "___prefill_addr_10.0.0.1:99999___decode_addr_10.0.0.2:22001_k",
        "___prefill_addr_10.0.0.1:123456___decode_addr_10.0.0.2:22001_k",
        "___prefill_addr_300.0.0.1:1___decode_addr_10.0.0.2:22001_k",
        "___prefill_addr_10.0.0.1___decode_addr_10.0.0.2:22001_k",  # no port
        "___prefill_addr_a_b:1___decode_addr_10.0.0.2:22001_k",
        f"___prefill_addr_h:1___decode_addr_h:2_{'k' * 129}",
        "cmpl-___decode_addr_10.0.0.2:22001_k-0-af5c0d3e",  # decode marker only
        "x___prefill_addr_",
    ],
)
def test_malformed_ids_are_an_error(request_id):
    with pytest.raises(PeerInfoError) as info:
        parse_peer_info(request_id, None)
    assert "\n" not in str(info.value)


def test_fields_never_run_into_each_other():
    """A greedy pattern would take the last decode address or eat the key."""
    proxy_id = make_request_id("10.0.0.1:21001", "10.0.0.2:22001", "first")
    other = make_request_id("10.0.0.3:1", "10.0.0.4:2", "second")
    peer = parse_peer_info(f"cmpl-{proxy_id}_{other}-0-af5c0d3e", None)
    assert (peer.prefill_addr, peer.decode_addr, peer.key) == (
        "10.0.0.1:21001",
        "10.0.0.2:22001",
        "first",
    )
    assert parse_peer_info(f"{proxy_id[:-1]}-{'9' * 50}", None).key == "firs"
    assert (
        parse_peer_info(make_request_id("h:1", "h:2", "k" * 128) + "-0", None).key
        == "k" * 128
    )


def test_addresses():
    assert split_addr("[::1]:21001") == ("::1", 21001)
    assert split_addr("node-7.example.com:80") == ("node-7.example.com", 80)
    assert format_addr("::1", 21001) == "[::1]:21001"
    assert format_addr("10.0.0.1", 1) == "10.0.0.1:1"
    for bad in (
        "::1:21001",
        "host",
        "host:",
        ":1",
        "h:1:2",
        "[::1]",
        5,
        "a" * 400 + ":1",
    ):
        with pytest.raises(PeerInfoError):
            split_addr(bad)
    with pytest.raises(PeerInfoError, match="prefill_addr"):
        make_request_id("10.0.0.1", "10.0.0.2:1")
    with pytest.raises(PeerInfoError, match="key"):
        make_request_id("10.0.0.1:1", "10.0.0.2:1", "not-alnum")


def test_repeated_addresses_are_parsed_once_and_errors_keep_their_label():
    """The router names the same peers on every request; only valid addresses
    are cached, so a bad one raises naming its own key every time."""
    from vllm_disagg.wire import peers as metadata

    metadata._split_valid_addr.cache_clear()
    for _ in range(3):
        assert split_addr("[2001:db8::7]:21001", "p") == ("2001:db8::7", 21001)
    assert metadata._split_valid_addr.cache_info().hits == 2
    for label in ("prefill_addr", "decode_addr", "prefill_addr"):
        with pytest.raises(
            PeerInfoError, match=f"^{label}: '999.1.1.1' is not an IPv4"
        ):
            split_addr("999.1.1.1:1", label)
    assert metadata._split_valid_addr.cache_info().currsize == 1


def test_huge_inputs_are_cheap():
    start = time.perf_counter()
    assert parse_peer_info("x" * 1_000_000, None) is None
    for junk in ("a" * 1_000_000, ("a." * 500_000), "1" * 1_000_000, "-" * 1_000_000):
        with pytest.raises(PeerInfoError):
            parse_peer_info(PREFILL_MARKER + junk, None)
        with pytest.raises(PeerInfoError):
            parse_peer_info(f"{PREFILL_MARKER}h:1{DECODE_MARKER}{junk}", None)
    with pytest.raises(PeerInfoError):
        parse_peer_info("x", {PREFILL_ADDR_KEY: "a" * 1_000_000 + ":1"})
    assert time.perf_counter() - start < 2.0


_FRAGMENTS = st.sampled_from(
    [
        PREFILL_MARKER,
        DECODE_MARKER,
        "_",
        "-",
        ":",
        "[",
        "]",
        "::1",
        "10.0.0.1",
        "21001",
        "99999",
        "abc",
        "host.name",
        "-0-af5c0d3e",
        "cmpl-",
        "%",
    ]
)
_IDS = st.one_of(
    st.text(max_size=300),
    st.lists(st.one_of(_FRAGMENTS, st.text(max_size=8)), max_size=30).map("".join),
)
_PARAMS = st.one_of(
    st.none(),
    st.dictionaries(
        st.sampled_from([*PEER_INFO_KEYS, "prompt_token_ids"]),
        st.one_of(st.none(), st.integers(), _IDS),
        max_size=4,
    ),
)


@settings(
    derandomize=True,
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_IDS, _PARAMS)
def test_fuzz_never_raises_anything_else(request_id, params):
    try:
        peer = parse_peer_info(request_id, params)
    except PeerInfoError as e:
        assert "\n" not in str(e) and len(str(e)) < 400
        return
    if peer is not None:
        # Whatever parses can be written back and parses the same.
        again = make_request_id(peer.prefill_addr, peer.decode_addr, peer.key)
        assert parse_peer_info(again, None) == peer
        assert parse_peer_info("", peer.to_kv_transfer_params()) == peer


_HOSTS = st.sampled_from(
    ["10.0.0.1", "[::1]", "[2001:db8::7]", "node-1.example.com", "localhost", "a"]
)
_BAD_HOSTS = st.sampled_from(
    ["::1", "[::x]", "a_b", "300.1.1.1", "-a", "", "[]", "a..b"]
)
_KEYS = st.text(
    st.sampled_from("0123456789abcdefXYZ"), min_size=1, max_size=MAX_KEY_CHARS
)
_WRAPS = st.sampled_from(
    ["{}", "cmpl-{}-0-af5c0d3e", "chatcmpl-{}-1a2b3c4d", "3_cmpl-{}-0-00"]
)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    _WRAPS,
    st.tuples(_HOSTS, st.integers(1, 65535), _HOSTS, st.integers(1, 65535), _KEYS),
    st.one_of(
        st.none(),
        st.tuples(st.integers(0, 4), st.one_of(_BAD_HOSTS, st.text(max_size=6))),
    ),
)
def test_fuzz_structured_ids(wrap, parts, damage):
    """Valid ids in every wrapping parse to exactly their parts; a damaged
    field gives PeerInfoError (or, rarely, still a valid id) and nothing else."""
    p_host, p_port, d_host, d_port, key = parts
    fields = [p_host, str(p_port), d_host, str(d_port), key]
    if damage is not None:
        fields[damage[0]] = damage[1]
    p_host, p_port, d_host, d_port, key = fields
    request_id = wrap.format(
        f"{PREFILL_MARKER}{p_host}:{p_port}{DECODE_MARKER}{d_host}:{d_port}_{key}"
    )
    try:
        peer = parse_peer_info(request_id, None)
    except PeerInfoError:
        assert damage is not None
        return
    if damage is None:
        assert (peer.prefill_addr, peer.decode_addr, peer.key) == (
            f"{p_host}:{p_port}",
            f"{d_host}:{d_port}",
            key,
        )
    else:
        assert peer is not None
