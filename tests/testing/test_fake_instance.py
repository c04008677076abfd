"""The fake ``vllm serve`` shared by the router tests and the router benchmark:
the answers the benchmark relies on (``max_tokens`` tokens, paced, with usage),
its process form, and that the router tests' conftest hands out this one fake."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import aiohttp
import requests

from vllm_disagg.testing.fake_instance import DELAY_KEY, FakeInstance, token_stream
from vllm_disagg.testing.server import get_free_port


async def post(fake: FakeInstance, body: dict) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{fake.url}/v1/completions", json=body) as resp,
    ):
        return resp.status, await resp.read()


def events(raw: bytes) -> list:
    return [
        json.loads(e.removeprefix(b"data: ")) if e != b"data: [DONE]" else "[DONE]"
        for e in raw.split(b"\n\n")
        if e
    ]


async def test_token_stream_answers_max_tokens_streamed_with_usage():
    fake = FakeInstance("d")
    fake.models = [{"id": "fake-model"}]
    fake.handler = token_stream
    await fake.start()
    try:
        body = {
            "prompt": "x",
            "max_tokens": 3,
            "stream": True,
            DELAY_KEY: 5,
            "stream_options": {"include_usage": True},
        }
        started = time.monotonic()
        status, raw = await post(fake, body)
        took = time.monotonic() - started
    finally:
        await fake.stop()
    assert status == 200
    got = events(raw)
    assert [e["choices"][0]["text"] for e in got[:3]] == [" t0", " t1", " t2"]
    assert got[3]["usage"]["completion_tokens"] == 3 and got[3]["model"] == "fake-model"
    assert got[4] == "[DONE]" and len(got) == 5
    assert took >= 0.01  # two pauses of 5 ms between three chunks
    assert len(fake.requests) == 1 and fake.requests[0].body["max_tokens"] == 3


async def test_token_stream_json_answer_and_no_record():
    fake = FakeInstance("p", record=False)
    fake.handler = token_stream
    await fake.start()
    try:
        status, raw = await post(fake, {"prompt": "x", "max_tokens": 2})
    finally:
        await fake.stop()
    answer = json.loads(raw)
    assert status == 200 and answer["choices"][0]["text"] == " t0 t1"
    assert answer["usage"]["completion_tokens"] == 2
    assert fake.requests == []


async def test_default_answer_is_the_name():
    fake = await FakeInstance("p1").start()
    try:
        status, raw = await post(fake, {"prompt": "x"})
    finally:
        await fake.stop()
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "p1"


def test_process_of_its_own_serves_until_stopped():
    port = get_free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_disagg.testing.fake_instance",
            "--name",
            "d",
            "--port",
            str(port),
            "--model",
            "m",
            "--tokens",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "fake instance did not come up"
            time.sleep(0.1)
        models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert models["data"] == [{"id": "m"}]
        answer = requests.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=5,
            json={"prompt": "x", "max_tokens": 4},
        ).json()
        assert answer["choices"][0]["text"] == " t0 t1 t2 t3"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_router_tests_use_this_fake():
    from tests.router import conftest

    assert conftest.FakeInstance is FakeInstance
