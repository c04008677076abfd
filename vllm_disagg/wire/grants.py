"""Peer grants: the router vouches for the peers it names in a request.

A request names its prefill and decode instances in its id or its
``kv_transfer_params`` (:mod:`.peers`), and an instance connects to the one
it names: prefill pushes KV to the decode, decode pulls from the prefill
(GET). Anyone who can send an HTTP request to an instance could otherwise
choose where it connects and which key its KV is filed under. So the router
signs what it names, ``(prefill address, decode address, key, expiry)``,
under the token the fleet already shares for service discovery
(``VLLM_DISAGG_ROUTER_TOKEN``), and puts the signature in
``kv_transfer_params[GRANT_KEY]``. Instances check it before they act on
the peers (or accept peers an operator lists in ``allowed_peers``).

A grant is ``v1.<expires, unix seconds>.<32 hex digits>``; the MAC is
HMAC-SHA256 over the canonical spelling of both addresses, so any spelling
the codec accepts verifies. A grant is bound to its key: reusing one for
another transfer, or with peers swapped, fails. A grant is good until it
expires, not for one use: an instance remembers each key it used until its
grant expires (the connector's ``UsedKeys``), so a grant replayed from a log
moves no KV a second time. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time

from vllm_disagg.wire.peers import PeerInfo, canonical_addr

GRANT_KEY = "p2p_grant"
GRANT_VERSION = "v1"
# Long enough for a request that waits in the router's and the instances'
# queues; short enough that a grant seen in a log is soon worthless.
DEFAULT_GRANT_TTL_S = 600.0
# A grant valid for longer than this was not made by a router of this code.
MAX_GRANT_TTL_S = 3600.0
MAC_HEX_CHARS = 32
MAX_GRANT_CHARS = 64
_GRANT_RE = re.compile(rf"v1\.([0-9]{{1,12}})\.([0-9a-f]{{{MAC_HEX_CHARS}}})")


class GrantError(ValueError):
    """A grant is missing, malformed, expired or not signed by the fleet's token."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def _spell(addr: str) -> str:
    host, port = canonical_addr(addr)
    return f"{host}|{port}"


def _mac(
    token: bytes, prefill_addr: str, decode_addr: str, key: str, expires: int
) -> str:
    text = (
        f"p2p-grant|{GRANT_VERSION}|{_spell(prefill_addr)}|{_spell(decode_addr)}"
        f"|{key}|{expires}"
    )
    return hmac.new(token, text.encode(), hashlib.sha256).hexdigest()[:MAC_HEX_CHARS]


def make_grant(
    token: bytes,
    prefill_addr: str,
    decode_addr: str,
    key: str,
    *,
    ttl_s: float = DEFAULT_GRANT_TTL_S,
    now: float | None = None,
) -> str:
    """The grant for one transfer of ``key`` from ``prefill_addr`` to
    ``decode_addr``."""
    if not token:
        raise ValueError("a grant needs a non-empty token")
    expires = int((time.time() if now is None else now) + ttl_s)
    mac = _mac(token, prefill_addr, decode_addr, key, expires)
    return f"{GRANT_VERSION}.{expires}.{mac}"


def check_grant(
    token: bytes, grant: object, peer: PeerInfo, *, now: float | None = None
) -> int:
    """When ``grant`` expires (unix seconds, at most :data:`MAX_GRANT_TTL_S`
    from ``now``); :class:`GrantError` unless it vouches for ``peer`` now."""
    if grant is None:
        raise GrantError("missing", "the request names peers without a grant")
    if not isinstance(grant, str) or len(grant) > MAX_GRANT_CHARS:
        raise GrantError("malformed", "the grant is not a string of the expected form")
    match = _GRANT_RE.fullmatch(grant)
    if match is None:
        raise GrantError("malformed", "the grant is not a string of the expected form")
    expires, mac = int(match[1]), match[2]
    now = time.time() if now is None else now
    expected = _mac(token, peer.prefill_addr, peer.decode_addr, peer.key, expires)
    if not hmac.compare_digest(mac, expected):
        raise GrantError("forged", "the grant does not match the named peers and key")
    if now > expires:
        raise GrantError("expired", f"the grant expired {now - expires:.0f} s ago")
    if expires - now > MAX_GRANT_TTL_S:
        raise GrantError("malformed", "the grant is valid for too long")
    return expires
