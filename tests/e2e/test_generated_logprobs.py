"""Logprobs on generated tokens (issue 46, point 3), end to end through the openai SDK in strict
mode: chat `logprobs: true` with `top_logprobs`, completions `logprobs`, with max_tokens other
than 1, in answers, streams, batch rows and Responses. Each generated token has its entry; a
greedy token is its step's top logprob; the top logprobs are a distribution's (sum at most 1)."""

import math

import httpx
import openai
import pytest

from tests.e2e.batch_helpers import line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID

MESSAGES = [{"role": "user", "content": "Count slowly from one to twenty, please."}]


def assert_greedy_entries(entries, count, top):
    """`entries` (chat-shaped, SDK objects): `count` of them, each its step's top token, its top
    logprobs sorted, `top` of them, whose probabilities sum to at most 1."""
    assert len(entries) == count
    for entry in entries:
        assert len(entry.top_logprobs) == top
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        values = [item.logprob for item in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(value <= 0 for value in values)
        assert sum(math.exp(value) for value in values) <= 1 + 1e-5


def test_a_16_token_chat_answers_a_logprob_for_every_token(client):
    answer = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=16, temperature=0,
                                            logprobs=True, top_logprobs=3)
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 16
    assert_greedy_entries(choice.logprobs.content, 16, 3)
    # Without the field, no logprobs; with max_tokens 1, scoring mode as before (one entry).
    plain = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    scored = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=1, logprobs=True,
                                            top_logprobs=3)
    assert len(scored.choices[0].logprobs.content) == 1
    assert scored.choices[0].logprobs.content[0].token == choice.logprobs.content[0].token


def test_a_stream_carries_each_chunks_logprobs(client):
    whole = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=2)
    entries = []
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=12, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                entries += choice.logprobs.content
    assert_greedy_entries(entries, 12, 2)
    assert [entry.token for entry in entries] == [entry.token for entry in whole.choices[0].logprobs.content]
    assert [entry.logprob for entry in entries] == pytest.approx([entry.logprob for entry in whole.choices[0].logprobs.content],
                                                                 abs=1e-5)


def test_completions_report_the_legacy_shape_for_each_generated_token(client):
    answer = client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=8, temperature=0,
                                       logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 2 and value == max(top.values())  # greedy: the top one
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=8, logprobs=6)
    assert caught.value.param == "logprobs" and "from 0 to 5" in caught.value.message


def test_a_batch_row_answers_its_tokens_logprobs(client):
    body = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True,
            "top_logprobs": 1}
    done = wait_for(client, start_batch(client, [line("lp", "/v1/chat/completions", body)], "/v1/chat/completions").id)
    assert done.status == "completed"
    [row] = read_jsonl(client, done.output_file_id)
    content = row["response"]["body"]["choices"][0]["logprobs"]["content"]
    sync = client.chat.completions.create(**body).choices[0].logprobs.content
    assert [entry["token"] for entry in content] == [entry.token for entry in sync] and len(content) == 6
    assert [entry["logprob"] for entry in content] == [entry.logprob for entry in sync]  # run alone: the same bits


def test_responses_include_output_text_logprobs(client, stack):
    answer = client.responses.create(model=MODEL_ID, input="Count to three.", max_output_tokens=6, temperature=0,
                                     include=["message.output_text.logprobs"], top_logprobs=2)
    part = answer.output[0].content[0]
    assert len(part.logprobs) == answer.usage.output_tokens == 6
    assert all(entry.top_logprobs[0].token == entry.token for entry in part.logprobs)
    events = list(client.responses.create(model=MODEL_ID, input="Count to three.", max_output_tokens=6, temperature=0,
                                          include=["message.output_text.logprobs"], top_logprobs=2, stream=True))
    streamed = [entry.token for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    assert streamed == [entry.token for entry in part.logprobs]
    refused = httpx.post(stack.web.url + "/v1/responses", json={"model": MODEL_ID, "input": "x",
                                                                 "include": ["file_search_call.results"]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "include.0"
