"""One row per option: how a value is read, its flag, and its line in the docs.

Every options table (the P2P connector's ``kv_connector_extra_config``, the
router's flags, step sync's ``--additional-config`` keys) is a tuple of
:class:`Option` rows. The config dataclass takes its defaults from the rows,
validates itself with :func:`parse_rows` (so a config built in code is checked
like one read from the command line), and the argparse flags
(:func:`add_arguments`) and the docs table (``tables.py``) are generated from
the same rows, so help, checks and docs cannot drift apart.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Parser = Callable[[str, Any], Any]  # (key to name in errors, value) -> field value


@dataclass(frozen=True)
class Option:
    """One option: a key users type, the field it fills, and its docs."""

    key: str  # JSON key, or the flag's name with underscores
    type: str  # docs: what the key accepts (Markdown)
    default: Any  # the config field's default
    parse: Parser
    help: str  # what it does (docs, and the flag's help)
    refused: str = ""  # docs: what start-up refuses
    field: str = ""  # the config's field, when not ``key``
    shown_default: str = ""  # docs: the default, when the value says too little
    check: Parser | None = None  # a field value, when its unit is not the key's
    absent: Callable[[], Any] | None = None  # the value when missing, if not default
    # Command-line flags only:
    group: str = ""  # argparse group title ("": the parser itself)
    metavar: str | None = None
    nargs: str | None = None

    @property
    def name(self) -> str:
        """The config field this option fills."""
        return self.field or self.key

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def by_key(options: Iterable[Option]) -> dict[str, Option]:
    return {option.key: option for option in options}


def parse_rows(
    options: Iterable[Option],
    given: Mapping[str, Any],
    label: Callable[[str], str],
    *,
    by_field: bool,
) -> dict[str, Any]:
    """Every option parsed by its row; absent ones take their defaults.

    ``given``: values by key (JSON, ``--additional-config``) or, with
    ``by_field``, by config field (direct construction, where a field's own
    unit is checked with ``check`` and ``None`` is the unset default).
    ``label`` names a key in errors. Returns the values by field name.
    """
    out: dict[str, Any] = {}
    for option in options:
        name = option.name if by_field else option.key
        if name not in given:
            out[option.name] = option.absent() if option.absent else option.default
        elif by_field and given[name] is None and option.default is None:
            out[option.name] = None
        else:
            parse = (option.check if by_field else None) or option.parse
            out[option.name] = parse(label(option.key), given[name])
    return out


def argparse_kwargs(option: Option) -> dict[str, Any]:
    """``add_argument`` keywords for one row (vLLM's ``_compute_kwargs`` idea):
    a boolean is a switch, a number converts with its type, the help is the
    docs' text. Values are checked by the config (one wording), not by argparse."""
    help_text = option.help.replace("%", "%%")
    if isinstance(option.default, bool):
        return {"action": "store_true", "help": help_text}
    kwargs: dict[str, Any] = {"default": option.default, "help": help_text}
    if option.nargs:
        kwargs.update(nargs=option.nargs, default=list(option.default or ()))
    elif isinstance(option.default, int | float):
        kwargs["type"] = type(option.default)
    if option.metavar:
        kwargs["metavar"] = option.metavar
    if option.default is not None and not option.nargs:
        kwargs["help"] += " (default %(default)s)"
    return kwargs


def add_arguments(
    parser: argparse.ArgumentParser, options: Iterable[Option]
) -> argparse.ArgumentParser:
    """One flag per row, in argument groups by ``Option.group``."""
    groups: dict[str, Any] = {"": parser}
    for option in options:
        if option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        groups[option.group].add_argument(option.flag, **argparse_kwargs(option))
    return parser


def from_namespace(options: Iterable[Option], args: argparse.Namespace) -> dict:
    """The parsed flags by config field (for the config's constructor)."""
    return {o.name: getattr(args, o.name) for o in options if hasattr(args, o.name)}
