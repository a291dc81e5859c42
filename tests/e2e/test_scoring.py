"""Scoring mode through the real processes, in both response shapes."""

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL_ID

MESSAGES = [{"role": "system", "content": "Answer yes or no."}, {"role": "user", "content": "Is water wet?"}]


def test_chat_scoring_answers_one_entry_with_top_logprobs(client):
    answer = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=1, logprobs=True, top_logprobs=4
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "length"
    [entry] = choice.logprobs.content
    assert [item.logprob for item in entry.top_logprobs] == sorted((item.logprob for item in entry.top_logprobs), reverse=True)
    assert len(entry.top_logprobs) == 4
    assert entry.top_logprobs[0].token == entry.token == choice.message.content
    assert entry.bytes == list(entry.token.encode())
    assert answer.usage.completion_tokens == 1


def test_completions_scoring_answers_the_legacy_shape(client):
    answer = client.completions.create(model=MODEL_ID, prompt="The answer is", max_tokens=1, logprobs=3)
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == [answer.choices[0].text]
    assert logprobs.text_offset == [0]
    assert len(logprobs.top_logprobs[0]) == 3
    assert logprobs.token_logprobs[0] == max(logprobs.top_logprobs[0].values())


def test_chat_scoring_equals_completions_scoring_of_the_rendered_prompt(client, resident):
    from inference_app.schemas import parse_request

    chat = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=1, logprobs=True, top_logprobs=5)
    rendered = resident.render_chat(
        parse_request("/v1/chat/completions", {"model": "m", "messages": MESSAGES}, True).request.messages
    )
    legacy = client.completions.create(model=MODEL_ID, prompt=rendered, max_tokens=1, logprobs=5)
    entry = chat.choices[0].logprobs.content[0]
    assert entry.logprob == legacy.choices[0].logprobs.token_logprobs[0]
    assert {item.token: item.logprob for item in entry.top_logprobs} == legacy.choices[0].logprobs.top_logprobs[0]


def test_allowed_token_ids_restrict_the_answer(client, resident):
    yes, no = resident.encode(" yes")[0], resident.encode(" no")[0]
    answer = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=1, logprobs=True, top_logprobs=5,
        extra_body={"allowed_token_ids": [yes, no]},
    )
    entry = answer.choices[0].logprobs.content[0]
    assert {item.token for item in entry.top_logprobs} == {" yes", " no"}
    assert answer.choices[0].message.content in (" yes", " no")


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"allowed_token_ids": [5]}, "max_completion_tokens"),
        ({"allowed_token_ids": [5], "max_tokens": 2}, "max_tokens"),
        ({"allowed_token_ids": [5], "max_tokens": 1, "stream": True}, "stream"),
        ({"logprobs": True, "max_tokens": 1, "temperature": 0.0001}, "temperature"),
        ({"logprobs": True, "max_tokens": 1, "n": 2}, "n"),
        ({"logprobs": True, "max_tokens": 1, "top_logprobs": 30}, "top_logprobs"),
        ({"top_logprobs": 3, "max_tokens": 1}, "top_logprobs"),
        ({"allowed_token_ids": [], "max_tokens": 1}, "allowed_token_ids"),
    ],
)
def test_every_scoring_constraint_is_refused_naming_the_field(stack, fields, param):
    body = {"model": MODEL_ID, "messages": MESSAGES, **fields}
    response = httpx.post(stack.web.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_completions_scoring_constraints_name_the_field(stack):
    body = {"model": MODEL_ID, "prompt": "x", "allowed_token_ids": [5]}
    response = httpx.post(stack.web.url + "/v1/completions", json=body)
    assert response.json()["error"]["param"] == "max_tokens"
    assert "got nothing" in response.json()["error"]["message"]


def test_a_token_outside_the_vocabulary_is_invalid_scoring_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=1, extra_body={"allowed_token_ids": [10**6]}
        )
    assert caught.value.code == "invalid_scoring_request"
