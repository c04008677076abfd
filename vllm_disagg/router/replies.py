"""What the router answers a client: a whole body or a stream, and its JSON
errors in upstream vLLM's format (so a client sees one API, router or not)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import msgspec

JSON = "application/json"


@dataclass
class Reply:
    """What the HTTP layer sends: a whole body or a stream of chunks."""

    status: int
    content_type: str
    body: bytes | AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)  # relayed from the instance


# vLLM's names for its own errors (entrypoints/serve/exception_handling), and
# the same style for the gateway errors only a router has.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "BadRequestError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
# What vLLM calls a request its FastAPI layer refused (body, content type).
VALIDATION_ERROR_TYPE = "Bad Request"


# What vLLM's error messages never show (its sanitize_message): memory
# addresses, traceback lines, local paths (a model's path is its default name).
_SANITIZE = (
    (re.compile(r" at 0x[0-9a-fA-F]+>"), ">"),
    (re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?'), ""),
    (re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+"), "<path>"),
    (re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+"), "<path>"),
)


def sanitize_message(message: str) -> str:
    for pattern, replacement in _SANITIZE:
        message = pattern.sub(replacement, message)
    return message.strip()


def error_json(
    status: int, message: str, param: str | None = None, error_type: str | None = None
) -> bytes:
    """Upstream vLLM's ErrorResponse: ``{"error": {message, type, param, code}}``,
    the message sanitized as vLLM sanitizes its own."""
    error_type = error_type or ERROR_TYPES.get(status, "InternalServerError")
    return msgspec.json.encode(
        {
            "error": {
                "message": sanitize_message(message),
                "type": error_type,
                "param": param,
                "code": status,
            }
        }
    )


def error_reply(
    status: int, message: str, param: str | None = None, error_type: str | None = None
) -> Reply:
    return Reply(status, JSON, error_json(status, message, param, error_type))


# Response headers of the answering instance that reach the client: vLLM's
# (--enable-request-id-headers); the rest are the connection's own.
RELAYED_RESPONSE_HEADERS = ("X-Request-Id",)


def relayed_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {h: resp.headers[h] for h in RELAYED_RESPONSE_HEADERS if h in resp.headers}


def content_type(resp: aiohttp.ClientResponse) -> str:
    """The upstream Content-Type header as sent (charset included)."""
    return resp.headers.get("Content-Type", JSON)
