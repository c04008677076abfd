"""The value parsers every options table shares, and the one wording of a
refusal: ``<key>: <value> is not <what is allowed>``.

Each parser takes the key (a JSON key, an ``--additional-config`` key or a
flag) to name and the value as given, and returns the typed value or raises
:class:`ConfigError`. Standard library only: the router, the connector's
options and step sync import it without importing vLLM.
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Any

from vllm_disagg.errors import ConfigError
from vllm_disagg.wire.peers import PeerInfoError, check_host

MAX_PORT = 65535
MAX_TIMEOUT_S = 86400.0
MAX_BYTE_SIZE = 1 << 50  # 1 PiB: anything larger is a typo


def show(value: Any) -> str:
    """A value for an error message: one line, bounded."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def refuse(key: str, value: Any, allowed: str) -> ConfigError:
    """The one wording of a refused value (raise what it returns)."""
    return ConfigError(f"{key}: {show(value)} is not {allowed}")


def number(key: str, value: Any, allowed: str) -> float:
    """An int, float or numeric string ("1e9", "21001") as a finite float."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise refuse(key, value, allowed)
    try:
        result = float(value.strip()) if isinstance(value, str) else float(value)
    except (ValueError, OverflowError):
        raise refuse(key, value, allowed) from None
    if not math.isfinite(result):
        raise refuse(key, value, allowed)
    return result


def port(key: str, value: Any, *, any_free: bool = False) -> int:
    """A TCP port: an integer or an integer string, 1..65535 (0 too with
    ``any_free``: the listener picks a free one)."""
    low = 0 if any_free else 1
    allowed = f"a port number (an integer {low}..{MAX_PORT}"
    allowed += "; 0: any free port)" if any_free else ")"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise refuse(key, value, allowed)
    result = value
    if isinstance(value, str):
        if not re.fullmatch(r"[0-9]{1,5}", value.strip()):  # int() takes "1_0", "٢"
            raise refuse(key, value, allowed)
        result = int(value)
    if not low <= result <= MAX_PORT:
        raise refuse(key, value, allowed)
    return result


def integer(key: str, value: Any, low: int, high: int) -> int:
    """An int (not a bool, not a string) in ``low..high``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not low <= value <= high
    ):
        raise refuse(key, value, f"an integer in {low}..{high}")
    return value


def seconds(
    key: str, value: Any, low: float = 0.0, high: float = MAX_TIMEOUT_S
) -> float:
    """A duration: a number (or numeric string) ``> 0`` (``low`` 0) or
    ``>= low``, and ``<= high``."""
    bound = "> 0" if low == 0 else f">= {low:g}"
    allowed = f"a number of seconds ({bound} and <= {high:g})"
    result = number(key, value, allowed)
    if not (result > 0 if low == 0 else result >= low) or result > high:
        raise refuse(key, value, allowed)
    return result


def byte_size(key: str, value: Any) -> int:
    """Bytes as an int, float or numeric string ("1e1", "8e9"), at most 1 PiB."""
    allowed = 'a number of bytes >= 0 and <= 1 PiB (e.g. 1e9 or "8e9")'
    result = number(key, value, allowed)
    if not 0 <= result <= MAX_BYTE_SIZE:
        raise refuse(key, value, allowed)
    return int(result)


def choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    """One of ``choices``, case-insensitively; returns the canonical spelling."""
    if isinstance(value, str):
        for option in choices:
            if value.strip().lower() == option.lower():
                return option
    raise refuse(key, value, f"one of {', '.join(choices)}")


def boolean(key: str, value: Any) -> bool:
    """A JSON ``true``/``false``; ``"yes"`` or ``1`` is a typo, not a choice."""
    if not isinstance(value, bool):
        raise refuse(key, value, "true or false")
    return value


def host(key: str, value: Any) -> str:
    """An IPv4 address, an IPv6 address (brackets optional) or a host name:
    the grammar of ``wire.peers`` (no underscores, no IPv6 zone ids)."""
    try:
        return check_host(value, key)
    except PeerInfoError as e:
        raise ConfigError(str(e)) from None


def advertised_host(key: str, value: Any, *, wildcard_hint: str = "") -> str:
    """A host another machine connects to: :func:`host`, but not a wildcard
    address (``0.0.0.0``, ``::``), which names no machine. ``wildcard_hint``
    is added to that refusal (where to put a wildcard instead)."""
    result = host(key, value)
    try:
        wildcard = ipaddress.ip_address(result).is_unspecified
    except ValueError:  # a host name
        wildcard = False
    if wildcard:
        raise ConfigError(
            f"{key}: {show(value)} is a wildcard address; give one that "
            "other machines can connect to" + wildcard_hint
        )
    return result


def host_port(key: str, item: Any, allowed: str) -> tuple[str, int | None]:
    """``host`` or ``host:port`` (IPv6 bracketed with a port, brackets optional
    without) as ``(host, port or None)``; the host is not a wildcard. A refusal
    names the whole item and ``allowed``."""
    if not isinstance(item, str):
        raise refuse(key, item, allowed)
    text, given_port = item.strip(), None
    if text.startswith("[") and "]:" in text:
        inner, given_port = text[1:].split("]:", 1)
        text = f"[{inner}]"
    elif text.count(":") == 1:  # IPv6 addresses have at least two
        text, given_port = text.split(":")
    try:
        result = host(key, text)
        parsed_port = None if given_port is None else port(key, given_port)
    except ConfigError:
        raise refuse(key, item, allowed) from None
    return advertised_host(key, result), parsed_port
