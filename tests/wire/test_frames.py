"""The one frame codec of discovery, the P2P control plane and step sync."""

from __future__ import annotations

import msgspec
import pytest

from vllm_disagg.wire.frames import MAC_BYTES, FrameCodec, FrameError


class Ping(msgspec.Struct, tag="ping", array_like=True, forbid_unknown_fields=True):
    n: int


A = FrameCodec(b"a", msgspec.msgpack.Decoder(Ping), 64)
B = FrameCodec(b"b", msgspec.msgpack.Decoder(Ping), 64)
KEY = b"k" * 32


def _kind(codec, key, frames) -> str:
    with pytest.raises(FrameError) as e:
        codec.open(key, frames)
    return e.value.kind


def test_sealed_frames_open_and_carry_a_mac_only_with_a_key():
    assert A.open(KEY, A.seal(KEY, Ping(1))) == Ping(1)
    assert len(A.seal(KEY, Ping(1))[1]) == MAC_BYTES
    assert A.seal(None, Ping(2))[1] == b"" and A.open(
        None, A.seal(None, Ping(2))
    ) == Ping(2)


def test_every_way_a_frame_is_wrong_is_one_error_with_a_kind():
    payload, mac = A.seal(KEY, Ping(1))
    assert _kind(A, KEY, [payload]) == "malformed"
    assert _kind(A, KEY, [payload, mac, b""]) == "malformed"
    assert _kind(A, KEY, [b"x" * 65, mac]) == "oversized"
    assert _kind(A, KEY, [payload, b""]) == "unauthenticated"
    assert _kind(A, KEY, [payload, b"\0" * MAC_BYTES]) == "unauthenticated"
    assert _kind(A, b"other" * 8, [payload, mac]) == "unauthenticated"
    assert _kind(A, None, [b"\xc1", b""]) == "malformed"
    assert _kind(A, KEY, A.seal(KEY, {"x": 1})) == "malformed"  # authentic, not a Ping


def test_a_frame_of_one_domain_never_verifies_in_another():
    """Discovery, P2P and each direction of step sync use their own label."""
    assert _kind(B, KEY, A.seal(KEY, Ping(1))) == "unauthenticated"
