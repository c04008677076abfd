"""The P2P control-plane protocol: sealing and opening frames.

Frames come off the network, so ``open_frame`` must turn everything that is
not a well-formed, bounded (and, with a secret, authenticated) message into a
:class:`FrameError` with the right ``kind`` -- the engine counts and
rate-limits rejections by kind -- and never raise anything else.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p import protocol as proto
from vllm_disagg.distributed.kv_transfer.kv_connector.v1.p2p.protocol import (
    MAC_BYTES,
    MAX_ADDR_CHARS,
    MAX_FRAME_BYTES,
    MAX_KEY_CHARS,
    MAX_REASON_CHARS,
    PROTOCOL_VERSION,
    FrameError,
    Get,
    Hello,
    LayoutSpec,
    Offer,
    Reply,
    Status,
    open_frame,
    seal,
)

SECRET = b"a shared secret"
OTHER_SECRET = b"another secret"

LAYOUT = LayoutSpec(num_layers=3, page_bytes=16384, block_size=32, dtype="float32")


def _hello(**kw) -> Hello:
    fields = dict(
        version=PROTOCOL_VERSION,
        req_no=1,
        sender_addr="127.0.0.1:5000",
        channel_id="0123456789abcdef",
        transport="tcp",
        setup=b"\x00" * 16,
        layout=LAYOUT,
        send_type="PUT_ASYNC",
        sent_at=1.8e9,
    )
    fields.update(kw)
    return Hello(**fields)


def _offer(**kw) -> Offer:
    fields = dict(
        req_no=2,
        channel_id="0123456789abcdef",
        key="cmpl-1___127.0.0.1:5000",
        xfer_id=0,
        num_blocks=4,
        prompt_digest=b"d" * 16,
        request_id="req-1",
    )
    fields.update(kw)
    return Offer(**fields)


def _get(**kw) -> Get:
    fields = dict(req_no=3, sender_addr="[::1]:6000", key="k", skip_blocks=2)
    fields.update(kw)
    return Get(**fields)


def _reply(**kw) -> Reply:
    fields = dict(req_no=4, status=Status.OK, reason="", setup=b"reply", skip_blocks=1)
    fields.update(kw)
    return Reply(**fields)


ALL_MESSAGES = [
    pytest.param(_hello(), id="hello"),
    pytest.param(_offer(), id="offer"),
    pytest.param(_offer(request_id=""), id="offer-no-request-id"),
    pytest.param(_get(), id="get"),
    pytest.param(_reply(), id="reply"),
    pytest.param(Reply(req_no=5, status=Status.NO_SPACE), id="reply-defaults"),
    pytest.param(
        _reply(status=Status.REJECTED, reason="r" * MAX_REASON_CHARS),
        id="reply-max-reason",
    ),
    pytest.param(_offer(key="k" * MAX_KEY_CHARS), id="offer-max-key"),
    pytest.param(
        _get(sender_addr="h" * MAX_ADDR_CHARS, skip_blocks=0), id="get-max-addr"
    ),
]


def _expect_error(kind: str, secret: bytes | None, frames: list[bytes]) -> FrameError:
    with pytest.raises(FrameError) as info:
        open_frame(secret, frames)
    assert info.value.kind == kind, str(info.value)
    assert isinstance(info.value, ValueError)
    return info.value


def _raw(tag: str, *fields) -> bytes:
    """A payload as the encoder would write it, for fields seal() cannot produce."""
    return msgspec.msgpack.encode([tag, *fields])


# --- round trips -------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
@pytest.mark.parametrize("msg", ALL_MESSAGES)
def test_seal_open_round_trip(msg, secret):
    frames = seal(secret, msg)
    assert len(frames) == 2 and all(isinstance(f, bytes) for f in frames)
    assert len(frames[1]) == (MAC_BYTES if secret else 0)
    opened = open_frame(secret, frames)
    assert type(opened) is type(msg)
    assert opened == msg


def test_every_status_round_trips():
    statuses = [v for k, v in vars(Status).items() if not k.startswith("_")]
    assert len(statuses) == 6
    for status in statuses:
        assert open_frame(None, seal(None, _reply(status=status))).status == status


def test_nested_layout_round_trips():
    msg = open_frame(SECRET, seal(SECRET, _hello(layout=LAYOUT)))
    assert isinstance(msg.layout, LayoutSpec)
    assert msg.layout == LAYOUT


# --- framing -----------------------------------------------------------------


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("count", [0, 1, 3, 5])
def test_wrong_frame_count_is_malformed(secret, count):
    payload, mac = seal(secret, _offer())
    frames = ([payload, mac] + [b"extra"] * 3)[:count] if count else []
    _expect_error("malformed", secret, frames)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_oversized_payload(secret):
    big = _offer(request_id="r" * (MAX_FRAME_BYTES + 1))
    frames = seal(secret, big)  # a valid MAC: the size check comes first anyway
    _expect_error("oversized", secret, frames)
    _expect_error("oversized", secret, [b"\x00" * (MAX_FRAME_BYTES + 1), b""])
    # exactly at the limit the size is fine (the payload is then judged on its content)
    _expect_error("malformed", None, [b"\xc1" * MAX_FRAME_BYTES, b""])


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1", id="never-used-byte"),
        pytest.param(b"\x93\x01", id="truncated-array"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http"),
        pytest.param(bytes(range(256)), id="all-bytes"),
        pytest.param(msgspec.msgpack.encode({"tag": "offer"}), id="map-not-array"),
        pytest.param(msgspec.msgpack.encode([]), id="empty-array"),
        pytest.param(msgspec.msgpack.encode(7), id="int"),
        pytest.param(b"\x91" * 2000 + b"\x00", id="deep-nesting"),
    ],
)
def test_garbage_is_malformed(payload):
    _expect_error("malformed", None, [payload, b""])


def test_unknown_tag_is_malformed():
    err = _expect_error("malformed", None, [_raw("bye", 1, 2), b""])
    assert "bye" in str(err) or "tag" in str(err).lower()
    # tags are case sensitive
    _expect_error("malformed", None, [_raw("Offer", 2, "c", "k", 0, 4, ""), b""])


def test_unknown_field_is_malformed():
    ok = _raw("get", 3, "a:1", "k", 0)
    assert isinstance(open_frame(None, [ok, b""]), Get)
    _expect_error("malformed", None, [_raw("get", 3, "a:1", "k", 0, "surplus"), b""])
    _expect_error("malformed", None, [_raw("reply", 1, "ok", "", b"", 0, 99), b""])
    # the nested layout forbids unknown fields too
    hello = seal(None, _hello())[0]
    fields = msgspec.msgpack.decode(hello)
    fields[8] = [*fields[8], "extra"]
    _expect_error("malformed", None, [msgspec.msgpack.encode(fields), b""])


def test_missing_required_field_is_malformed():
    _expect_error("malformed", None, [_raw("get", 3, "a:1", "k"), b""])
    _expect_error("malformed", None, [_raw("offer", 2, "c", "k", 0), b""])


@pytest.mark.parametrize(
    "msg",
    [
        pytest.param(_offer(num_blocks="4"), id="offer-num_blocks-str"),
        pytest.param(_offer(key=5), id="offer-key-int"),
        pytest.param(_offer(num_blocks=4.0), id="offer-num_blocks-float"),
        pytest.param(_get(skip_blocks=None), id="get-skip-none"),
        pytest.param(_hello(setup="not bytes but text"), id="hello-setup-str"),
        pytest.param(_hello(version="1"), id="hello-version-str"),
        pytest.param(_hello(layout=[3, 16384, 32]), id="hello-layout-short"),
        pytest.param(_hello(layout={"num_layers": 3}), id="hello-layout-map"),
        pytest.param(_reply(status=1), id="reply-status-int"),
        pytest.param(_reply(req_no=True), id="reply-req_no-bool"),
    ],
)
def test_wrong_field_types_are_malformed(msg):
    try:
        frames = seal(None, msg)
    except (OverflowError, TypeError, msgspec.EncodeError):
        pytest.skip("the encoder refuses this value itself")
    _expect_error("malformed", None, frames)


# --- bounds ------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        pytest.param(_offer(key=""), id="offer-key-empty"),
        pytest.param(_offer(key="k" * (MAX_KEY_CHARS + 1)), id="offer-key-long"),
        pytest.param(_offer(num_blocks=0), id="offer-num_blocks-0"),
        pytest.param(_offer(num_blocks=-3), id="offer-num_blocks-negative"),
        pytest.param(_offer(channel_id="c" * 65), id="offer-channel-long"),
        pytest.param(_offer(request_id="r" * 513), id="offer-request-id-long"),
        pytest.param(_get(key=""), id="get-key-empty"),
        pytest.param(_get(key="k" * (MAX_KEY_CHARS + 1)), id="get-key-long"),
        pytest.param(_get(skip_blocks=-1), id="get-skip-negative"),
        pytest.param(_get(sender_addr="h" * (MAX_ADDR_CHARS + 1)), id="get-addr-long"),
        pytest.param(
            _hello(sender_addr="h" * (MAX_ADDR_CHARS + 1)), id="hello-addr-long"
        ),
        pytest.param(_hello(channel_id="c" * 65), id="hello-channel-long"),
        pytest.param(_hello(transport="t" * 17), id="hello-transport-long"),
        pytest.param(_hello(send_type="s" * 17), id="hello-send_type-long"),
        pytest.param(
            _reply(reason="r" * (MAX_REASON_CHARS + 1)), id="reply-reason-long"
        ),
        pytest.param(_reply(skip_blocks=-1), id="reply-skip-negative"),
    ],
)
@pytest.mark.parametrize("secret", [None, SECRET])
def test_out_of_bounds_fields_are_malformed(msg, secret):
    _expect_error("malformed", secret, seal(secret, msg))


def test_bounds_limits_are_inclusive():
    for msg in [
        _offer(key="k"),
        _offer(key="k" * MAX_KEY_CHARS),
        _offer(num_blocks=1),
        _offer(channel_id="c" * 64),
        _offer(request_id="r" * 512),
        _get(skip_blocks=0),
        _hello(sender_addr="h" * MAX_ADDR_CHARS),
        _hello(transport="t" * 16, send_type="s" * 16, channel_id="c" * 64),
        _reply(reason="r" * MAX_REASON_CHARS, skip_blocks=0),
    ]:
        assert open_frame(None, seal(None, msg)) == msg


# --- authentication ----------------------------------------------------------


@pytest.mark.parametrize("msg", ALL_MESSAGES)
def test_secret_rejects_missing_wrong_and_foreign_macs(msg):
    payload, mac = seal(SECRET, msg)
    assert open_frame(SECRET, [payload, mac]) == msg
    _expect_error("unauthenticated", SECRET, [payload, b""])  # missing
    _expect_error("unauthenticated", SECRET, seal(None, msg))  # sender has no secret
    _expect_error("unauthenticated", SECRET, [payload, b"\x00" * MAC_BYTES])  # wrong
    _expect_error("unauthenticated", SECRET, [payload, mac[:-1]])  # truncated
    _expect_error("unauthenticated", SECRET, [payload, mac + b"\x00"])  # too long
    flipped = bytes([mac[0] ^ 1]) + mac[1:]
    _expect_error("unauthenticated", SECRET, [payload, flipped])
    _expect_error("unauthenticated", SECRET, seal(OTHER_SECRET, msg))  # another secret
    # the MAC covers the payload: a tampered payload fails even with its old MAC
    tampered = seal(SECRET, msg)[0].replace(b"\x01", b"\x02", 1)
    if tampered != payload:
        _expect_error("unauthenticated", SECRET, [tampered, mac])


def test_authentication_comes_before_decoding():
    # A peer without the secret learns nothing about the decoder: garbage and
    # out-of-bounds messages are "unauthenticated", not "malformed".
    _expect_error("unauthenticated", SECRET, [b"\xc1garbage", b""])
    _expect_error("unauthenticated", SECRET, seal(OTHER_SECRET, _offer(key="")))
    _expect_error("unauthenticated", SECRET, [_raw("bye"), b"x" * MAC_BYTES])
    # ... but garbage that carries a valid MAC is judged on its content
    garbage = b"\xc1garbage"
    _expect_error("malformed", SECRET, [garbage, proto._codec.mac(SECRET, garbage)])
    _expect_error("malformed", SECRET, seal(SECRET, _offer(key="")))


@pytest.mark.parametrize("msg", ALL_MESSAGES)
def test_without_secret_any_mac_is_accepted(msg):
    payload, _ = seal(None, msg)
    for mac in [b"", b"\x00" * MAC_BYTES, b"junk", seal(SECRET, msg)[1]]:
        assert open_frame(None, [payload, mac]) == msg
    assert open_frame(b"", seal(None, msg)) == msg  # an empty secret is no secret


def test_mac_is_domain_separated_and_truncated():
    payload = seal(None, _get())[0]
    mac = seal(SECRET, _get())[1]
    assert mac != hmac.new(SECRET, payload, hashlib.sha256).digest()[:MAC_BYTES]
    assert len(mac) == MAC_BYTES


# --- fuzz --------------------------------------------------------------------

# The same examples on every run (CI must be reproducible) and no shrinking,
# so a failure is reported at once with the input that caused it.
FUZZ = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_TAGS = st.sampled_from(["hello", "offer", "get", "reply", "Hello", "", "x" * 40])
_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=140),
    st.binary(max_size=40),
)
_VALUE = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=4), max_leaves=12)


def _check_result(msg) -> None:
    """What open_frame returns is a Message within the bounds."""
    assert isinstance(msg, (Hello, Offer, Get, Reply)), type(msg)
    if isinstance(msg, Offer):
        assert 0 < len(msg.key) <= MAX_KEY_CHARS and msg.num_blocks > 0
    elif isinstance(msg, Get):
        assert 0 < len(msg.key) <= MAX_KEY_CHARS and msg.skip_blocks >= 0
        assert len(msg.sender_addr) <= MAX_ADDR_CHARS
    elif isinstance(msg, Reply):
        assert len(msg.reason) <= MAX_REASON_CHARS and msg.skip_blocks >= 0
    else:
        assert isinstance(msg.layout, LayoutSpec)
        assert len(msg.sender_addr) <= MAX_ADDR_CHARS


def _open_or_reject(secret, frames) -> None:
    try:
        msg = open_frame(secret, frames)
    except FrameError as e:
        assert e.kind in {"malformed", "oversized", "unauthenticated"}, e.kind
        return
    _check_result(msg)


@FUZZ
@given(
    frames=st.lists(st.binary(max_size=64), max_size=4)
    | st.tuples(st.binary(max_size=MAX_FRAME_BYTES + 64), st.binary(max_size=20)).map(
        list
    ),
    secret=st.sampled_from([None, SECRET]),
)
def test_fuzz_arbitrary_bytes_only_raise_frame_error(frames, secret):
    _open_or_reject(secret, frames)


@settings(FUZZ, max_examples=250)
@given(
    tag=_TAGS,
    fields=st.lists(_VALUE, max_size=10),
    secret=st.sampled_from([None, SECRET]),
)
def test_fuzz_structured_payloads_only_raise_frame_error(tag, fields, secret):
    # Well-formed msgpack arrays starting with a (mostly) known tag get past
    # the byte level and exercise field validation and the bounds checks.
    try:
        payload = msgspec.msgpack.encode([tag, *fields])
    except (OverflowError, msgspec.EncodeError):
        return
    mac = proto._codec.mac(secret, payload) if secret else b""
    _open_or_reject(secret, [payload, mac])


@FUZZ
@given(
    msg=st.one_of(
        st.builds(
            _offer,
            key=st.text(max_size=MAX_KEY_CHARS + 4),
            num_blocks=st.integers(-5, 2**63 - 1),
            request_id=st.text(max_size=600),
        ),
        st.builds(
            _get,
            key=st.text(max_size=MAX_KEY_CHARS + 4),
            skip_blocks=st.integers(-(2**63), 2**63 - 1),
            sender_addr=st.text(max_size=MAX_ADDR_CHARS + 4),
        ),
        st.builds(
            _reply,
            reason=st.text(max_size=MAX_REASON_CHARS + 4),
            skip_blocks=st.integers(-3, 3),
            status=st.text(max_size=12),
        ),
    ),
    secret=st.sampled_from([None, SECRET]),
)
def test_fuzz_sealed_messages_open_iff_in_bounds(msg, secret):
    frames = seal(secret, msg)
    try:
        opened = open_frame(secret, frames)
    except FrameError as e:
        assert e.kind == "malformed", e
        assert not _in_bounds(msg), f"{msg} is within bounds but was rejected: {e}"
        return
    assert _in_bounds(msg), f"{msg} is out of bounds but was accepted"
    _check_result(opened)
    assert opened == msg


def _in_bounds(msg) -> bool:
    if isinstance(msg, Offer):
        return (
            0 < len(msg.key) <= MAX_KEY_CHARS
            and msg.num_blocks > 0
            and len(msg.request_id) <= 512
        )
    if isinstance(msg, Get):
        return (
            0 < len(msg.key) <= MAX_KEY_CHARS
            and msg.skip_blocks >= 0
            and len(msg.sender_addr) <= MAX_ADDR_CHARS
        )
    return len(msg.reason) <= MAX_REASON_CHARS and msg.skip_blocks >= 0


# --- layers per data message -------------------------------------------------


@pytest.mark.parametrize(
    "num_layers, layer_bytes, target, expected",
    [
        (4, 100, 1, [[0], [1], [2], [3]]),  # every layer reaches the target
        (4, 100, 250, [[0, 1, 2], [3]]),  # ceil(250 / 100) = 3 per message
        (4, 100, 10_000, [[0, 1, 2, 3]]),  # capped at the transfer's layers
        (3, 0, 10, [[0], [1], [2]]),  # nothing to carry: one message a layer
        (1, 5, 5, [[0]]),
    ],
)
def test_layer_groups_cover_every_layer_once_in_order(
    num_layers, layer_bytes, target, expected
):
    groups = proto.layer_groups(num_layers, layer_bytes, target)
    assert [list(g) for g in groups] == expected


def test_layer_groups_follow_the_module_target(monkeypatch):
    # Read at call time: both ends of a test (one process) set it together.
    monkeypatch.setattr(proto, "LAYER_MESSAGE_BYTES", 200)
    assert [len(g) for g in proto.layer_groups(5, 100)] == [2, 2, 1]
    # A 2 MiB layer goes alone at the default.
    monkeypatch.undo()
    assert len(proto.layer_groups(32, 2 << 20)) == 32
    assert len(proto.layer_groups(32, 128 << 10)) == 2
