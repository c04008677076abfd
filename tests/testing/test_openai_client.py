"""Client helpers against a stand-in HTTP server (no vLLM): request bodies,
server-sent events, prompts, and the per-rank step-sync metric scrape."""

from __future__ import annotations

import contextlib
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from vllm_disagg.testing import openai_client
from vllm_disagg.testing.server import VllmServer
from vllm_disagg.testing.step_sync import step_sync_metric

CHUNKS = [
    {"choices": [{"text": "a", "token_ids": [5, 6]}]},
    {"choices": [{"text": "", "token_ids": None}]},
    {"choices": [{"text": "b", "token_ids": [7]}]},
]
METRICS_TEXT = """\
# HELP vllm_disagg:step_sync_local_step Forward passes (real + dummy) run so far.
# TYPE vllm_disagg:step_sync_local_step gauge
vllm_disagg:step_sync_local_step{dp_rank="0"} 12.0
vllm_disagg:step_sync_local_step{dp_rank="1"} 11.0
# TYPE vllm_disagg:step_sync_forward_steps counter
vllm_disagg:step_sync_forward_steps_total{dp_rank="1"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        assert self.path == "/metrics"
        self._send(200, METRICS_TEXT.encode(), "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, dict(self.headers), body))
        if body.get("prompt") == "fail":
            return self._send(400, b'{"error": "bad"}', "application/json")
        if not body.get("stream"):
            return self._send(
                200, json.dumps({"choices": [{"token_ids": [1, 2]}]}).encode()
            )
        events = [": comment\n\n", *(f"data: {json.dumps(c)}\n\n" for c in CHUNKS)]
        self._send(
            200, "".join([*events, "data: [DONE]\n\n"]).encode(), "text/event-stream"
        )

    def _send(self, status, payload, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def server(tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.requests = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    stand_in = VllmServer(
        "tiny", port=httpd.server_address[1], log_path=tmp_path / "log"
    )
    stand_in.httpd = httpd
    yield stand_in
    httpd.shutdown()
    httpd.server_close()


def test_complete_sends_model_prompt_params_and_headers(server):
    body = openai_client.complete(
        server,
        "hi",
        headers={"X-data-parallel-rank": "1"},
        max_tokens=3,
        temperature=0.0,
    )
    assert body["choices"][0]["token_ids"] == [1, 2]
    path, headers, sent = server.httpd.requests[-1]
    assert path == "/v1/completions" and headers["X-data-parallel-rank"] == "1"
    assert sent == {
        "model": "tiny",
        "prompt": "hi",
        "max_tokens": 3,
        "temperature": 0.0,
    }
    assert server.complete("hi", max_tokens=3) == body  # VllmServer delegates here
    with pytest.raises(requests.HTTPError):
        openai_client.complete(server, "fail")


def test_stream_completion_yields_chunks_and_token_ids(server):
    chunks = list(
        openai_client.stream_completion(server, "hi", max_tokens=3, stream=False)
    )
    assert chunks == CHUNKS
    assert [openai_client.token_ids(c) for c in chunks] == [[5, 6], [], [7]]
    assert server.httpd.requests[-1][2]["stream"] is True
    with pytest.raises(requests.HTTPError):
        next(openai_client.stream_completion(server, "fail"))


def test_stream_can_be_closed_early(server):
    with contextlib.closing(openai_client.stream_completion(server, "hi")) as chunks:
        first = next(chunks)
    assert first == CHUNKS[0]
    with pytest.raises(StopIteration):
        next(chunks)


def test_sse_data_skips_everything_but_data_lines():
    lines = [
        b"",
        b": keep-alive",
        b'data: {"a": 1}',
        b"event: x",
        b'data: {"b": 2}',
        b"data: [DONE]",
    ]
    assert list(openai_client.sse_data(lines)) == [{"a": 1}, {"b": 2}]


def test_random_prompt_is_reproducible_and_draws_the_count_first():
    prompt = openai_client.random_prompt(random.Random(3), 1, 48)
    assert prompt == openai_client.random_prompt(random.Random(3), 1, 48)
    rng = random.Random(3)  # the inline expression the helper replaced
    words = openai_client.WORDS
    assert prompt == " ".join(rng.choice(words) for _ in range(rng.randint(1, 48)))
    assert set(prompt.split()) <= set(words)


def test_step_sync_metric_is_per_rank(server):
    assert step_sync_metric(server, "local_step") == {0: 12.0, 1: 11.0}
    assert step_sync_metric(server, "forward_steps_total") == {1: 3.0}
    assert step_sync_metric(server, "dummy_steps_total") == {}
