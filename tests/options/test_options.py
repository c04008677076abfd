"""The shared options layer: one refusal wording, rows to argparse and docs."""

from __future__ import annotations

import argparse

import pytest

from vllm_disagg.errors import ConfigError
from vllm_disagg.options import parsers, tables
from vllm_disagg.options.rows import Option, add_arguments, from_namespace, parse_rows


def _error(parse, *args) -> str:
    with pytest.raises(ConfigError) as e:
        parse(*args)
    return str(e.value)


@pytest.mark.parametrize(
    ("parse", "value", "allowed"),
    [
        (parsers.port, "0", "a port number (an integer 1..65535)"),
        (parsers.port, True, "a port number (an integer 1..65535)"),
        (parsers.port, "1_0", "a port number (an integer 1..65535)"),
        (parsers.seconds, 0, "a number of seconds (> 0 and <= 86400)"),
        (parsers.seconds, "nan", "a number of seconds (> 0 and <= 86400)"),
        (
            parsers.byte_size,
            -1,
            'a number of bytes >= 0 and <= 1 PiB (e.g. 1e9 or "8e9")',
        ),
        (
            parsers.byte_size,
            1e16,
            'a number of bytes >= 0 and <= 1 PiB (e.g. 1e9 or "8e9")',
        ),
        (parsers.boolean, "yes", "true or false"),
        (parsers.host, "a_b", "an IPv4 or IPv6 address or a host name"),
        (parsers.host, "999.1.1.1", "an IPv4 or IPv6 address or a host name"),
    ],
)
def test_every_refusal_has_one_wording(parse, value, allowed):
    assert _error(parse, "k", value) == f"k: {parsers.show(value)} is not {allowed}"


def test_parsers_return_typed_canonical_values():
    assert parsers.port("k", " 21001") == 21001
    assert parsers.port("k", 0, any_free=True) == 0
    assert parsers.seconds("k", "2.5") == 2.5
    assert parsers.seconds("k", 0.1, 0.1, 3600) == 0.1
    assert "(>= 0.1 and <= 3600)" in _error(parsers.seconds, "k", 0.05, 0.1, 3600)
    assert parsers.byte_size("k", "1e9") == 10**9
    assert parsers.choice("k", "put_async", ("PUT", "PUT_ASYNC")) == "PUT_ASYNC"
    assert parsers.integer("k", 3, 1, 4) == 3
    assert _error(parsers.integer, "k", "3", 1, 4) == "k: '3' is not an integer in 1..4"
    assert parsers.host("k", "[0:0::1]") == "::1"
    assert parsers.host("k", "Node-1.example") == "Node-1.example"
    assert "wildcard" in _error(parsers.advertised_host, "k", "0.0.0.0")
    assert parsers.host_port("k", "[::1]:5", "x") == ("::1", 5)
    assert _error(parsers.host_port, "k", "h:0", "an address") == (
        "k: 'h:0' is not an address"
    )


ROWS = (
    Option("port", "port", 80, parsers.port, "where", group="net"),
    Option("ratio_s", "seconds", 1.5, parsers.seconds, "how long"),
    Option("loud", "switch", False, parsers.boolean, "say more"),
    Option("items", "list", (), lambda k, v: tuple(v), "things", nargs="+"),
    Option("name", "string", None, lambda k, v: v, "who", field="who"),
)


def test_argparse_and_config_come_from_the_rows():
    parser = add_arguments(argparse.ArgumentParser(), ROWS)
    args = parser.parse_args(["--port", "81", "--loud", "--items", "a", "b"])
    values = from_namespace(ROWS, args)
    assert values == {
        "port": 81,
        "ratio_s": 1.5,
        "loud": True,
        "items": ["a", "b"],
    }
    parsed = parse_rows(ROWS, values, lambda key: "--" + key, by_field=True)
    assert parsed == {
        "port": 81,
        "ratio_s": 1.5,
        "loud": True,
        "items": ("a", "b"),
        "who": None,
    }
    assert [g.title for g in parser._action_groups][-1] == "net"
    assert "(default 80)" in parser.format_help()


def test_parse_rows_by_key_names_the_key_and_fills_defaults():
    assert parse_rows(ROWS, {"name": "x"}, str, by_field=False)["who"] == "x"
    with pytest.raises(ConfigError) as e:
        parse_rows(ROWS, {"port": "x"}, lambda k: f"cfg.{k}", by_field=False)
    message = str(e.value)
    assert message.startswith("cfg.port: 'x' is not a port number")


def test_markdown_table_has_one_row_per_option():
    text = tables.markdown_table(ROWS, tables.KEY_COLUMNS)
    lines = text.splitlines()
    assert lines[0] == "| key | type | default | meaning | refused |"
    assert lines[2] == "| `port` | port | 80 | where |  |"
    assert len(lines) == 2 + len(ROWS)
