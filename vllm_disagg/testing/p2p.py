"""Drive a prefill/decode pair the way the design document's proxy does.

``disaggregated_completion`` sends the request to the prefill instance with
``max_tokens=1`` (non-streaming), then the original request to the decode
instance with the same ``X-Request-Id``: the seed's id that names both
peers' KV addresses, or (``via_params=True``) a plain id with the peers in
``kv_transfer_params``, as the router does. Either way the request carries
the grant a router would sign (``kv_transfer_params.p2p_grant``) under the
test fleets' token (or ``token``), unless ``grant=False``.
:func:`router_token_on_this_host` is the token instances started by hand
on loopback use when nothing is exported.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from vllm_disagg import envs
from vllm_disagg.testing import openai_client
from vllm_disagg.testing.server import VllmServer, fleet_router_token, get_free_port
from vllm_disagg.wire.cookie import ROUTER_TOKEN, load_cookie
from vllm_disagg.wire.grants import GRANT_KEY, make_grant
from vllm_disagg.wire.peers import make_kv_transfer_params, make_request_id


def kv_transfer_config(role: str, kv_port: int, **extra: Any) -> str:
    """The ``--kv-transfer-config`` JSON of the design document for loopback tests."""
    return json.dumps(
        {
            "kv_connector": "P2pNcclConnector",
            "kv_role": role,
            "kv_buffer_size": str(extra.pop("kv_buffer_size", "1e9")),
            "kv_port": str(kv_port),
            "kv_connector_extra_config": {"kv_ip": "127.0.0.1", **extra},
        }
    )


class P2pInstance:
    """A started ``vllm serve`` with its connector's address (TP rank 0 worker)."""

    def __init__(self, server: VllmServer, kv_port: int):
        self.server = server
        self.kv_port = kv_port

    @property
    def kv_addr(self) -> str:
        return f"127.0.0.1:{self.kv_port}"

    def __getattr__(self, name: str):
        return getattr(self.server, name)


def router_token_on_this_host() -> bytes:
    """The router token of instances on this host: ``VLLM_DISAGG_ROUTER_TOKEN``,
    else the key this user's instances on loopback derive from the local
    cookie (``vllm_disagg/wire/cookie.py``), for a proxy of one's own."""
    return envs.router_token() or load_cookie().key(ROUTER_TOKEN)


def free_kv_port(span: int = 4) -> int:
    """A ``kv_port`` with ``span - 1`` free ports after it (one per worker)."""
    return get_free_port(span)


def peer_naming(
    prefill_addr: str,
    decode_addr: str,
    *,
    key: str | None = None,
    via_params: bool = False,
    grant: bool = True,
    token: bytes | None = None,
) -> tuple[dict[str, str], dict[str, Any]]:
    """(headers, body fields) naming the peers of one request as a proxy
    does: the seed's ``X-Request-Id``, or (``via_params``) the peers in
    ``kv_transfer_params``; with the router's grant under ``token`` (default:
    the test fleet's) unless ``grant=False``."""
    key = key or uuid.uuid4().hex
    params: dict[str, str] = {}
    if via_params:
        request_id = f"router-{key}"
        params = make_kv_transfer_params(prefill_addr, decode_addr, key)
    else:
        request_id = make_request_id(prefill_addr, decode_addr, key)
    if grant:
        params[GRANT_KEY] = make_grant(
            token or fleet_router_token(), prefill_addr, decode_addr, key
        )
    return {"X-Request-Id": request_id}, (
        {"kv_transfer_params": params} if params else {}
    )


def disaggregated_completion(
    prefill: P2pInstance,
    decode: P2pInstance,
    prompt: str | list[int],
    *,
    max_tokens: int,
    via_params: bool = False,
    key: str | None = None,
    grant: bool = True,
    token: bytes | None = None,
    timeout_s: float = 120.0,
    **params: Any,
) -> dict:
    """Prefill on ``prefill`` (1 token), then the whole request on ``decode``: decode's
    response. The grant is signed with ``token`` (default: the test fleet's)."""
    headers, body_extra = peer_naming(
        prefill.kv_addr,
        decode.kv_addr,
        key=key,
        via_params=via_params,
        grant=grant,
        token=token,
    )
    openai_client.complete(
        prefill,
        prompt,
        headers=headers,
        timeout_s=timeout_s,
        max_tokens=1,
        temperature=0.0,
        **body_extra,
        **params,
    )
    return openai_client.complete(
        decode,
        prompt,
        headers=headers,
        timeout_s=timeout_s,
        max_tokens=max_tokens,
        temperature=0.0,
        **body_extra,
        **params,
    )
