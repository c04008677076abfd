"""Migration: the ledger's token bookkeeping and chunk translation (no I/O),
and whole migrations through an in-process router whose fake decodes speak
vLLM's stream format, generate deterministically (the next token is a
function of all tokens before it) and die mid-stream on demand.

The real thing (vLLM decodes killed by PID, output compared with a
colocated run): tests/v1/kv_connector/p2p/test_p2p_e2e.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from vllm_disagg.router.migratable import not_migratable_reason
from vllm_disagg.router.migration import StreamLedger, split_events
from vllm_disagg.wire.discovery import Role

PROMPT_IDS = [5, 6, 7]


def next_token(ids: list[int]) -> int:
    return (sum(ids) * 31 + len(ids)) % 997 + 3


def greedy(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token([*prompt, *out]))
    return out


def event(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def events_of(data: bytes) -> list:
    out = []
    for e in data.split(b"\n\n"):
        if e.startswith(b"data: "):
            payload = e[6:]
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


# --- what may move ---------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "path", "reason"),
    [
        ({"prompt": "a", "max_tokens": 5, "temperature": 0}, "/v1/completions", None),
        (
            {"messages": [{"role": "user", "content": "a"}]},
            "/v1/chat/completions",
            None,
        ),
        ({"prompt": "a", "stop": ["x"]}, "/v1/completions", "stop"),
        ({"prompt": "a", "stop": []}, "/v1/completions", None),
        ({"prompt": "a", "n": 2}, "/v1/completions", "n"),
        ({"prompt": "a", "logprobs": 0}, "/v1/completions", "logprobs"),
        ({"prompt": "a", "echo": True}, "/v1/completions", "echo"),
        ({"prompt": "a", "seed": 1}, "/v1/completions", "seed"),
        ({"prompt": "a", "presence_penalty": 0.5}, "/v1/completions", "penalties"),
        ({"prompt": "a", "repetition_penalty": 1.0}, "/v1/completions", None),
        ({"prompt": ["a", "b"]}, "/v1/completions", "prompts"),
        ({"prompt": [[1, 2]]}, "/v1/completions", None),
        ({"prompt": "a", "vllm_xargs": {"x": 1}}, "/v1/completions", "option"),
        (
            {"messages": [], "tools": [{"type": "function"}]},
            "/v1/chat/completions",
            "tools",
        ),
        (
            {"messages": [], "response_format": {"type": "json_object"}},
            "/v1/chat/completions",
            "structured_output",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "/v1/chat/completions",
            "multimodal",
        ),
        ({"input": "a"}, "/v1/responses", "option"),
    ],
)
def test_what_can_be_continued_exactly(body, path, reason):
    assert not_migratable_reason(body, path) == reason


def test_events_are_split_on_blank_lines_and_the_rest_waits():
    events, rest = split_events(b"data: 1\n\ndata: 2\n\ndata: 3")
    assert events == [b"data: 1", b"data: 2"] and rest == b"data: 3"


# --- the first decode's chunks --------------------------------------------


def completion_chunk(ids, *, first=False, finish=None, text="t", cid="cmpl-1"):
    return {
        "id": cid,
        "object": "text_completion",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": PROMPT_IDS if first else None,
                "token_ids": ids,
            }
        ],
    }


def test_token_ids_the_client_did_not_ask_for_are_hidden_and_counted():
    ledger = StreamLedger({"prompt": "x", "max_tokens": 10}, "/v1/completions", False)
    raw = event(completion_chunk([11], first=True)) + event(completion_chunk([12, 13]))
    # Cut inside the second event: it waits for its rest.
    out = ledger.feed(raw[:-7]) + ledger.feed(raw[-7:])
    chunks = events_of(out)
    assert [c["choices"][0]["token_ids"] for c in chunks] == [None, None]
    assert chunks[0]["choices"][0]["prompt_token_ids"] is None
    assert ledger.prompt_ids == PROMPT_IDS and ledger.generated == [11, 12, 13]
    body = ledger.continuation_body()
    # The chunk of two tokens may hide a pending character: the continuation
    # starts after 11, the last one-token chunk with text.
    assert body["prompt"] == [*PROMPT_IDS, 11]
    assert body["max_tokens"] == 9 and body["stream"] and body["return_token_ids"]
    assert "messages" not in body


def test_a_client_that_asked_for_token_ids_gets_the_bytes_unchanged():
    ledger = StreamLedger({"prompt": "x"}, "/v1/completions", True)
    raw = event(completion_chunk([11], first=True))
    assert ledger.feed(raw) == raw
    assert "max_tokens" not in ledger.continuation_body()  # the model's length


def test_min_tokens_left_and_max_completion_tokens_of_a_chat():
    body = {"messages": [], "max_completion_tokens": 9, "min_tokens": 4}
    ledger = StreamLedger(body, "/v1/chat/completions", False)
    for tok, text in ((2, "x"), (3, "y")):
        chunk = {
            "id": "c",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "token_ids": [tok]}],
            "prompt_token_ids": [1],
        }
        ledger.feed(event(chunk))
    cont = ledger.continuation_body()
    assert cont["prompt"] == [1, 2, 3]
    assert cont["max_tokens"] == 7 and cont["min_tokens"] == 2


# --- continuations ----------------------------------------------------------


def test_a_completion_continuation_keeps_ids_and_counts_usage_from_the_prompt():
    body = {"prompt": "x", "max_tokens": 4, "stream_options": {"include_usage": True}}
    ledger = StreamLedger(body, "/v1/completions", False)
    ledger.feed(event(completion_chunk([11], first=True)))
    ledger.start_continuation()
    cont_first = completion_chunk([12], cid="cmpl-2")
    cont_first["choices"][0]["prompt_token_ids"] = [*PROMPT_IDS, 11]
    usage = {
        "id": "cmpl-2",
        "object": "text_completion",
        "created": 200,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3},
    }
    out = ledger.feed(
        event(cont_first)
        + event(completion_chunk([13, 14], finish="length", cid="cmpl-2"))
        + event(usage)
        + b"data: [DONE]\n\n"
    )
    chunks = events_of(out)
    assert chunks[-1] == "[DONE]"
    for chunk in chunks[:-1]:
        assert (chunk["id"], chunk["created"]) == ("cmpl-1", 100)
    assert chunks[0]["choices"][0]["prompt_token_ids"] is None
    assert chunks[1]["choices"][0]["finish_reason"] == "length"
    assert chunks[2]["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 7,
        "completion_tokens": 4,
    }
    assert ledger.generated == [11, 12, 13, 14] and ledger.done


def test_a_chat_continuation_becomes_chat_chunks():
    ledger = StreamLedger({"messages": []}, "/v1/chat/completions", False)
    first = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": PROMPT_IDS,
    }
    token = {
        **first,
        "choices": [
            {
                "index": 0,
                "delta": {"content": "a"},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": [11],
            }
        ],
    }
    token.pop("prompt_token_ids")
    out = events_of(ledger.feed(event(first) + event(token)))
    assert out[0]["prompt_token_ids"] is None
    assert out[1]["choices"][0]["token_ids"] is None
    assert ledger.prompt_ids == PROMPT_IDS and ledger.generated == [11]
    assert ledger.why_not_resumable() is None
    ledger.start_continuation()
    cont = completion_chunk([12], finish="stop", text="b", cid="cmpl-9")
    (chunk,) = events_of(ledger.feed(event(cont)))
    assert chunk == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 100,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "b"},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": None,
            }
        ],
    }


def test_a_chat_delta_a_parser_made_is_not_continued():
    ledger = StreamLedger({"messages": []}, "/v1/chat/completions", False)
    parsed = {
        "id": "c",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"reasoning": "hm"}, "token_ids": [4]}],
        "prompt_token_ids": [1],
    }
    ledger.feed(event(parsed))
    assert ledger.why_not_resumable() == "parser"


def test_a_chat_without_a_plain_content_token_yet_is_not_continued():
    """The role chunk alone does not say whether the server parses reasoning
    out of the text: a continuation would send the raw text as content."""
    ledger = StreamLedger({"messages": []}, "/v1/chat/completions", False)
    role = {
        "id": "c",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        "prompt_token_ids": [1],
    }
    ledger.feed(event(role))
    assert ledger.why_not_resumable() == "before_first_token"
    token = {
        **role,
        "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [4]}],
    }
    ledger.feed(event(token))
    assert ledger.why_not_resumable() is None


def test_a_decode_that_died_after_its_last_token_owes_only_usage_and_done():
    body = {"prompt": "x", "stream_options": {"include_usage": True}}
    ledger = StreamLedger(body, "/v1/completions", False)
    ledger.feed(event(completion_chunk([11], first=True, finish="stop")))
    closing = events_of(ledger.closing_events())
    assert closing[0]["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 4,
        "completion_tokens": 1,
    }
    assert closing[1] == "[DONE]"


# --- through a router: fake decodes that generate and die -------------------


def make_decode(die_after: int | None, hang: bool = False):
    """A vLLM-like streaming completion handler: tokens of ``greedy``, one
    event each, ``[DONE]`` at the end; the connection cut (``hang``: silent
    for good) after ``die_after`` tokens."""

    async def handler(fake, request, body):
        prompt = body["prompt"]
        prompt = PROMPT_IDS if isinstance(prompt, str) else list(prompt)
        limit = body.get("max_tokens") or 50
        if not body.get("stream"):
            if die_after is not None:
                await asyncio.sleep(0.05)
                request.transport.close()
                return web.Response()
            out = greedy(prompt, limit)
            return web.json_response(
                {
                    "id": "cmpl-x",
                    "object": "text_completion",
                    "choices": [
                        {"index": 0, "token_ids": out, "finish_reason": "length"}
                    ],
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids: list[int] = []
        for i in range(limit):
            if die_after is not None and i == die_after:
                await asyncio.sleep(3600 if hang else 0.02)
                request.transport.close()
                return resp
            tok = next_token([*prompt, *ids])
            ids.append(tok)
            chunk = completion_chunk(
                [tok] if body.get("return_token_ids") else None,
                finish="length" if i == limit - 1 else None,
                cid=f"cmpl-{fake.name}",
            )
            chunk["choices"][0]["prompt_token_ids"] = (
                prompt if i == 0 and body.get("return_token_ids") else None
            )
            await resp.write(event(chunk))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return handler


async def two_decodes(fakes, start_router, dying: int | None, **config):
    router = await start_router(**config)
    p, d1, d2 = await fakes("p"), await fakes("d1"), await fakes("d2")
    router.add(p, Role.PREFILL)
    router.add(d1, Role.DECODE)
    router.add(d2, Role.DECODE)
    d1.handler = make_decode(dying)
    d2.handler = make_decode(dying)
    return router, p, d1, d2


STREAM = {"model": "m", "prompt": "x", "max_tokens": 20, "stream": True}


async def test_a_stream_whose_decode_dies_continues_on_the_other_pair(
    fakes, start_router
):
    router, p, d1, d2 = await two_decodes(fakes, start_router, None)
    # Whichever decode gets the request dies after 6 tokens; the other lives.
    calls = []

    def dying_once(inner_dying, inner_alive):
        async def handler(fake, request, body):
            calls.append(fake.name)
            if len(calls) == 1:
                return await inner_dying(fake, request, body)
            return await inner_alive(fake, request, body)

        return handler

    for d in (d1, d2):
        d.handler = dying_once(make_decode(6), make_decode(None))
    status, raw, _ = await router.post("/v1/completions", STREAM)
    assert status == 200
    chunks = events_of(raw)
    assert chunks.count("[DONE]") == 1 and chunks[-1] == "[DONE]"
    tokens = chunks[:-1]
    assert all(c["id"] == f"cmpl-{calls[0]}" for c in tokens)  # the first decode's
    assert all(c["choices"][0]["token_ids"] is None for c in tokens)
    assert len(tokens) == 20 and tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert calls[0] != calls[1]  # never the decode that failed
    second = d1 if calls[1] == "d1" else d2
    cont = second.requests[-1].body
    assert cont["prompt"] == [*PROMPT_IDS, *greedy(PROMPT_IDS, 6)]
    assert cont["max_tokens"] == 14
    # The prefill computed the continuation's prefix, under a new transfer key.
    assert p.requests[-1].body["prompt"] == cont["prompt"]
    first_params, cont_params = (r.body["kv_transfer_params"] for r in p.requests)
    assert first_params != cont_params
    assert cont["kv_transfer_params"] == cont_params
    assert (
        router.metric(
            "vllm_disagg_router_migrations_total", outcome="resumed", reason="broken"
        )
        == 1
    )


async def test_no_pair_left_ends_the_stream_with_an_error_event_and_done(
    fakes, start_router
):
    router, p, d1, d2 = await two_decodes(fakes, start_router, 3)
    status, raw, _ = await router.post("/v1/completions", STREAM)
    assert status == 200
    chunks = events_of(raw)
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    error = chunks[-2]["error"]
    assert error["code"] == 502 and error["type"] == "BadGatewayError"
    assert "no other healthy pair" in error["message"]
    assert len(chunks) == 3 + 3 + 2  # both decodes sent 3 tokens, then died
    assert (
        router.metric(
            "vllm_disagg_router_migrations_total", outcome="no_pair", reason=""
        )
        == 1
    )


async def test_max_migrations_zero_keeps_the_old_ending(fakes, start_router):
    router, p, d1, d2 = await two_decodes(fakes, start_router, 3, max_migrations=0)
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert (
        chunks[-1] == "[DONE]" and "broke the stream" in chunks[-2]["error"]["message"]
    )
    assert len(d1.requests) + len(d2.requests) == 1


async def test_a_non_streamed_request_runs_again_elsewhere_or_fails_with_503(
    fakes, start_router
):
    router, p, d1, d2 = await two_decodes(fakes, start_router, None)
    d1.handler = make_decode(0)  # d1 dies while it generates
    body = {"model": "m", "prompt": "x", "max_tokens": 5}
    answers = [await router.post("/v1/completions", body) for _ in range(2)]
    for status, raw, _ in answers:
        assert status == 200
        assert json.loads(raw)["choices"][0]["token_ids"] == greedy(PROMPT_IDS, 5)
    d2.handler = make_decode(0)
    status, raw, _ = await router.post("/v1/completions", body)
    assert status == 503 and json.loads(raw)["error"]["code"] == 503


async def test_a_stream_with_stop_strings_is_not_migrated_and_counted(
    fakes, start_router
):
    router, p, d1, d2 = await two_decodes(fakes, start_router, 3)
    status, raw, _ = await router.post("/v1/completions", {**STREAM, "stop": ["x"]})
    chunks = events_of(raw)
    assert (
        chunks[-1] == "[DONE]" and "broke the stream" in chunks[-2]["error"]["message"]
    )
    assert len(d1.requests) + len(d2.requests) == 1
    assert "return_token_ids" not in (d1.requests or d2.requests)[0].body
    assert (
        router.metric(
            "vllm_disagg_router_migrations_total",
            outcome="not_migratable",
            reason="stop",
        )
        == 1
    )


async def test_a_stalled_decode_is_left_and_its_stream_continues(fakes, start_router):
    router, p, d1, d2 = await two_decodes(
        fakes, start_router, None, chunk_timeout_s=0.3
    )
    calls = []

    def first_stalls(fake, request, body):
        calls.append(fake)
        handler = make_decode(4, hang=True) if len(calls) == 1 else make_decode(None)
        return handler(fake, request, body)

    d1.handler = d2.handler = first_stalls
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert (
        status == 200
        and chunks[-1] == "[DONE]"
        and not any("error" in c for c in chunks[:-1])
    )
    assert [c["choices"][0]["token_ids"] for c in chunks[:-1]] == [None] * 20
    assert calls[0] is not calls[1]
    # The stalled decode's request was closed (vLLM aborts it).
    await asyncio.wait_for(calls[0].disconnected.wait(), 2)
    assert (
        router.metric(
            "vllm_disagg_router_migrations_total", outcome="resumed", reason="stalled"
        )
        == 1
    )


# --- the join: a character pending at the seam ------------------------------


def cont_chunk(ids, text, finish=None):
    return completion_chunk(ids, text=text, finish=finish, cid="cmpl-2")


def fed_with_a_pending_character(client_token_ids: bool) -> StreamLedger:
    """A stream that sent "a" for 11, then "" for 12 (a character's first
    bytes) when its decode died."""
    ledger = StreamLedger({"prompt": "x"}, "/v1/completions", client_token_ids)
    ledger.feed(event(completion_chunk([11], first=True, text="a")))
    ledger.feed(event(completion_chunk([12], text="")))
    return ledger


@pytest.mark.parametrize("client_token_ids", [False, True])
def test_a_continuation_starts_before_a_pending_character(client_token_ids):
    ledger = fed_with_a_pending_character(client_token_ids)
    assert ledger.continuation_body()["prompt"] == [*PROMPT_IDS, 11]
    ledger.start_continuation()
    # The new decode makes 12 again (""), then 13 completes the character.
    out = events_of(
        ledger.feed(
            event(cont_chunk([12], ""))
            + event(cont_chunk([13], "€"))
            + event(cont_chunk([14], "b", finish="length"))
        )
    )
    texts = [c["choices"][0]["text"] for c in out]
    ids = [c["choices"][0]["token_ids"] for c in out]
    assert texts == ["€", "b"]  # 12's repeat carried nothing new: not sent
    assert ids == ([[13], [14]] if client_token_ids else [None, None])
    assert ledger.generated == [11, 12, 13, 14] and not ledger.join_failed


def test_text_sent_after_the_seam_is_owed_again_and_checked():
    ledger = StreamLedger({"prompt": "x"}, "/v1/completions", False)
    ledger.feed(event(completion_chunk([11], first=True, text="a")))
    ledger.feed(event(completion_chunk([12, 13], text="bc")))  # merged chunk
    ledger.start_continuation()
    out = events_of(
        ledger.feed(
            event(cont_chunk([12], "b"))
            + event(cont_chunk([13], "c"))
            + event(cont_chunk([14], "d"))
        )
    )
    assert [c["choices"][0]["text"] for c in out] == ["d"]
    # A second migration goes on from 14, the continuation's own clean seam.
    assert ledger.continuation_body()["prompt"] == [*PROMPT_IDS, 11, 12, 13, 14]


@pytest.mark.parametrize(
    ("client_token_ids", "repeat", "why"),
    [
        (False, cont_chunk([12, 13], "bX"), "text"),
        (True, cont_chunk([99], "b"), "token ids"),
        (False, cont_chunk([12], "b", finish="stop"), "text"),
    ],
)
def test_a_continuation_that_does_not_repeat_what_was_sent_ends_the_stream(
    client_token_ids, repeat, why
):
    ledger = StreamLedger({"prompt": "x"}, "/v1/completions", client_token_ids)
    ledger.feed(event(completion_chunk([11], first=True, text="a")))
    ledger.feed(event(completion_chunk([12, 13], text="bc")))
    ledger.start_continuation()
    out = events_of(ledger.feed(event(repeat) + event(cont_chunk([14], "d"))))
    assert ledger.join_failed == why and ledger.done
    assert out[-1] == "[DONE]" and out[-2]["error"]["code"] == 502
    assert why in out[-2]["error"]["message"]
    assert ledger.feed(event(cont_chunk([15], "e"))) == b""  # nothing after


def test_a_sampled_continuation_may_differ_where_the_client_saw_nothing():
    ledger = fed_with_a_pending_character(False)
    ledger.start_continuation()
    out = events_of(ledger.feed(event(cont_chunk([40], "z"))))
    assert [c["choices"][0]["text"] for c in out] == ["z"]
    assert ledger.generated == [11, 40] and not ledger.join_failed


# A decode whose detokenizer works like vLLM's: a token divisible by 4 holds
# the first bytes of a character ("" sent), the next token sends the whole
# character; primed with a prompt that ends on such a token, the first
# character comes out garbled, as tokenizers' DecodeStream does.


def token_text(prev: int | None, tok: int) -> str:
    if tok % 4 == 0:
        return ""
    if prev is not None and prev % 4 == 0:
        return chr(0x4E00 + prev + tok)
    return chr(0x61 + tok % 26)


def make_detokenizing_decode(die_after: int | None):
    async def handler(fake, request, body):
        prompt = body["prompt"]
        prompt = PROMPT_IDS if isinstance(prompt, str) else list(prompt)
        limit = body.get("max_tokens") or 50
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids: list[int] = []
        garbled = prompt[-1] % 4 == 0
        for i in range(limit):
            if die_after is not None and i == die_after:
                await asyncio.sleep(0.02)
                request.transport.close()
                return resp
            tok = next_token([*prompt, *ids])
            prev = ids[-1] if ids else None
            text = token_text(prev, tok)
            if garbled and text:
                text, garbled = "\ufffd", False
            ids.append(tok)
            chunk = completion_chunk(
                [tok] if body.get("return_token_ids") else None,
                finish="length" if i == limit - 1 else None,
                text=text,
                cid=f"cmpl-{fake.name}",
            )
            chunk["choices"][0]["prompt_token_ids"] = (
                prompt if i == 0 and body.get("return_token_ids") else None
            )
            await resp.write(event(chunk))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    return handler


async def test_a_character_pending_at_the_seam_reaches_the_client_whole(
    fakes, start_router
):
    reference = greedy(PROMPT_IDS, 40)
    pending = [i for i, t in enumerate(reference) if t % 4 == 0 and i > 0]
    assert pending, "the generator must hold a character somewhere"
    die_after = pending[0] + 1  # the decode dies right after a pending token
    want = "".join(
        token_text(reference[i - 1] if i else None, t) for i, t in enumerate(reference)
    )
    router, p, d1, d2 = await two_decodes(fakes, start_router, None)
    calls = []

    def first_dies(fake, request, body):
        calls.append(fake.name)
        return make_detokenizing_decode(die_after if len(calls) == 1 else None)(
            fake, request, body
        )

    d1.handler = d2.handler = first_dies
    for client_ids in (False, True):
        calls.clear()
        body = {**STREAM, "max_tokens": 40, "return_token_ids": client_ids}
        status, raw, _ = await router.post("/v1/completions", body)
        chunks = events_of(raw)
        assert status == 200 and chunks[-1] == "[DONE]", chunks[-3:]
        assert len(calls) == 2 and calls[0] != calls[1]
        got = "".join(c["choices"][0]["text"] for c in chunks[:-1])
        assert got == want
        if client_ids:
            sent = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
            assert sent == reference
    second = d1 if calls[1] == "d1" else d2
    # The continuation began before the pending token, not after it.
    assert second.requests[-1].body["prompt"] == [*PROMPT_IDS, *reference[: pending[0]]]


async def test_a_continuation_that_disagrees_is_counted_and_closed(fakes, start_router):
    router, p, d1, d2 = await two_decodes(fakes, start_router, None)
    calls = []

    async def first_dies_then_differs(fake, request, body):
        calls.append(fake)
        if len(calls) == 1:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            first = completion_chunk([11], first=True, text="a", cid="cmpl-1")
            await resp.write(event(first))
            await resp.write(event(completion_chunk([12, 13], text="bc")))
            await asyncio.sleep(0.02)
            request.transport.close()
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event(cont_chunk([12], "b")))
        await resp.write(event(cont_chunk([13], "X")))
        await asyncio.sleep(3600)  # the router must close this one
        return resp

    d1.handler = d2.handler = first_dies_then_differs
    status, raw, _ = await router.post("/v1/completions", STREAM)
    chunks = events_of(raw)
    assert (
        chunks[-1] == "[DONE]"
        and "did not repeat the text" in (chunks[-2]["error"]["message"])
    )
    assert "".join(c["choices"][0]["text"] for c in chunks[:-2]) == "abc"
    await asyncio.wait_for(calls[1].disconnected.wait(), 2)
    assert (
        router.metric(
            "vllm_disagg_router_migrations_total", outcome="not_joined", reason="text"
        )
        == 1
    )
