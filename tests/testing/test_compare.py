"""The field-by-field comparison of two HTTP servers (no vLLM): views of JSON,
event-stream and text answers, field paths, normalized fields, known
differences, and the report."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_disagg.testing import compare
from vllm_disagg.testing.compare import ABSENT, FieldDifference, FieldRules, HttpCase

RULES = FieldRules(normalize={"id": compare.id_shape, "created": compare.type_name})


def _paths(diffs):
    return [d.path for d in diffs]


def test_views_of_json_stream_and_text_answers():
    view = compare.answer_view(
        200, {"Content-Type": "application/json; charset=utf-8"}, b'{"a": 1}'
    )
    assert view == {
        "status": 200,
        "content_type": "application/json",
        "headers": {},
        "body": {"a": 1},
    }
    stream = (
        b': ping\n\ndata: {"choices": [{"index": 0, "text": "a", "token_ids": '
        b"[1]}]}\n\n"
        b'data: {"choices": [{"index": 1, "delta": {"content": "x"}}]}\r\n\r\n'
        b'data: {"choices": [{"index": 0, "text": "b", "token_ids": [2, 3]}]}\n\n'
        b"event: error\ndata: {}\n\ndata: [DONE]\n\n"
    )
    view = compare.answer_view(
        200,
        {"content-type": "text/event-stream", "X-Request-Id": "r"},
        stream,
        keep_headers=("x-request-id",),
    )
    assert view["headers"] == {"x-request-id": "r"}
    assert view["stream"] == {
        "merged": {
            "choices": [
                {"index": 0, "text": "ab", "token_ids": [1, 2, 3]},
                {"index": 1, "delta": {"content": "x"}},
            ],
            "<other>": [{"<unparsed>": "event: error\ndata: {}"}],
        },
        "done": True,
    }
    assert len(view[compare.SSE_EVENTS]) == 5
    assert (
        compare.answer_view(404, {"content-type": "text/plain"}, b"nope")["body"]
        == "nope"
    )
    assert compare.answer_view(200, {}, b"")["body"] == ""


def _chunk(index, text, finish=None, usage=None):
    return {
        "id": "cmpl-1",
        "choices": [
            {
                "index": index,
                "text": text,
                "finish_reason": finish,
                "logprobs": {"tokens": list(text)},
            }
        ],
        "usage": usage,
    }


def test_a_stream_is_the_same_however_its_events_are_grouped():
    one_by_one = [
        _chunk(0, "a"),
        _chunk(1, "x"),
        _chunk(0, "b"),
        _chunk(1, "y", "stop"),
        _chunk(0, "c", "length"),
        {"id": "cmpl-1", "choices": [], "usage": {"n": 5}},
        "[DONE]",
    ]
    grouped = [
        _chunk(1, "xy", "stop", usage={"n": 2}),
        _chunk(0, "abc", "length"),
        {"id": "cmpl-1", "choices": [], "usage": {"n": 5}},
        "[DONE]",
    ]
    view = compare.stream_view(one_by_one)
    assert view == compare.stream_view(grouped)
    assert view["merged"]["choices"][0] == {
        "index": 0,
        "text": "abc",
        "finish_reason": "length",
        "logprobs": {"tokens": ["a", "b", "c"]},
    }
    assert view["merged"]["usage"] == {"n": 5}
    assert compare.stream_view(grouped[:-1])["done"] is False
    assert compare.stream_view([*grouped, "[DONE]"])["done"] is False
    assert compare.stream_view([_chunk(0, "abd")])["merged"] != compare.stream_view(
        grouped
    )


def test_differences_name_every_field_path():
    a = {
        "id": "cmpl-0123456789abcdef",
        "created": 1,
        "choices": [{"text": "a", "x": 1}],
        "usage": None,
    }
    b = {
        "id": "cmpl-fedcba9876543210",
        "created": 2,
        "choices": [{"text": "b"}, {"text": "c"}],
        "extra": True,
        "usage": {"n": 1},
    }
    diffs = compare.differences(a, b, RULES)
    assert diffs == [
        FieldDifference("choices[0].text", "a", "b"),
        FieldDifference("choices[0].x", 1, ABSENT),
        FieldDifference("choices[1]", ABSENT, {"text": "c"}),
        FieldDifference("usage", None, {"n": 1}),
        FieldDifference("extra", ABSENT, True),
    ]
    # Normalized fields are compared as they are when a case says so.
    assert _paths(compare.differences(a, b, RULES, exact={"id"}))[0] == "id"
    # An id's fixed part counts: another prefix, or an address in it.
    assert _paths(
        compare.differences(
            {"id": "cmpl-ab12cd34ef"}, {"id": "chatcmpl-ab12cd34ef"}, RULES
        )
    ) == ["id"]
    assert compare.id_shape("cmpl-___prefill_addr_127.0.0.1:42111") == (
        "cmpl-___prefill_addr_127.0.0.1:42111"
    )
    # 1 and 1.0, True and 1 are different values; floats within a tolerance are equal.
    assert _paths(compare.differences([1, True], [1.0, 1])) == ["[0]", "[1]"]
    assert compare.differences(1.0, 1.0 + 1e-9, FieldRules(float_rel_tol=1e-6)) == []
    assert compare.differences(1.0, 1.1, FieldRules(float_rel_tol=1e-6)) != []


def test_known_differences_cover_paths_and_stale_entries_are_reported():
    assert compare.path_matches("body.error", "body.error.param")
    assert compare.path_matches("body.error", "body.error")
    assert not compare.path_matches("body.error", "body.errors")
    assert compare.path_matches("stream.events[*].id", "stream.events[12].id")
    assert not compare.path_matches("stream.events[*].id", "stream.events[12].choices")
    assert compare.path_matches("body.data[*]", "body.data[0].root")
    assert compare.path_matches("*", "stream.events[3].choices[0].text")
    diffs = {
        "a": [FieldDifference("body.x", 1, 2), FieldDifference("body.y.z", 1, 2)],
        "b": [],
        "c": [FieldDifference("status", 200, 400)],
    }
    known = {
        "a": (("body.y",), "why"),
        "b": (("body",), "why"),
        "gone": (("status",), "why"),
    }
    unexpected, stale = compare.split_known(diffs, known)
    assert unexpected == {
        "a": [FieldDifference("body.x", 1, 2)],
        "c": [FieldDifference("status", 200, 400)],
    }
    assert stale == {"gone": ["<no such case>"], "b": ["body"]}
    report = compare.format_differences(unexpected, "router", "vllm", per_case=1)
    assert report.splitlines() == [
        "a: body.x: router=1 vllm=2",
        "c: status: router=200 vllm=400",
    ]
    many = {"d": [FieldDifference(f"p{i}", "x" * 200, ABSENT) for i in range(3)]}
    lines = compare.format_differences(many, per_case=2, width=20).splitlines()
    cut = '"' + "x" * 16 + "..."  # 20 characters
    assert lines == [
        f"d: p0: a={cut} b=<absent>",
        f"d: p1: a={cut} b=<absent>",
        "d: ... and 1 more",
    ]


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self._answer(None)

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer(raw)

    def _answer(self, raw):
        flavour = self.server.flavour
        if self.path == "/stream":
            chunks = [
                {
                    "id": f"cmpl-{flavour}0000000{i}",
                    "choices": [{"index": 0, "text": t}],
                }
                for i, t in enumerate("ab")
            ]
            payload = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
            if flavour == "a":
                payload += "data: [DONE]\n\n"
            return self._send(200, payload.encode(), "text/event-stream")
        body = {
            "path": self.path,
            "method": self.command,
            "got": raw.decode() if raw else None,
            "content_type": self.headers.get("Content-Type"),
            "id": f"cmpl-{flavour}00000000",
            "created": 1 if flavour == "a" else 2,
        }
        self._send(200, json.dumps(body).encode(), "application/json")

    def _send(self, status, payload, content_type):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@contextlib.contextmanager
def _server(flavour):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.flavour = flavour
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def two_servers():
    with _server("a") as a, _server("b") as b:
        yield a, b


def test_compare_servers_sends_each_case_to_both(two_servers):
    cases = [
        HttpCase("json", "/x", {"k": 1}),
        HttpCase("raw text", "/x", raw=b"[1,", headers={"Content-Type": "text/plain"}),
        HttpCase("get", "/x", method="GET"),
        HttpCase("stream", "/stream", method="GET"),
    ]
    diffs, views = compare.compare_servers(*two_servers, cases, RULES)
    assert diffs["json"] == diffs["raw text"] == diffs["get"] == []
    assert views["json"][0]["body"]["got"] == '{"k": 1}'
    assert views["raw text"][0]["body"]["got"] == "[1,"
    assert views["raw text"][0]["body"]["content_type"] == "text/plain"
    assert views["get"][1]["body"]["method"] == "GET"
    assert _paths(diffs["stream"]) == ["stream.done"]  # ids: the same shape
    assert len(views["stream"][0][compare.SSE_EVENTS]) == 3
    with pytest.raises(AssertionError, match="unique"):
        compare.compare_servers(*two_servers, [cases[0], cases[0]])
    down = compare.send("http://127.0.0.1:1", cases[0], timeout_s=5)
    assert down == {"exception": "ConnectionError"}
