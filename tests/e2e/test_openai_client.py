"""The official openai client, with strict response validation, against real web and engine."""

import base64
import struct
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.conftest import MODEL_ID, make_client

MESSAGES = [{"role": "user", "content": "Say something."}]


def test_chat_answers_with_text_usage_and_provenance(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL_ID, messages=MESSAGES, max_tokens=8, seed=7)
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-") and len(completion.id) == len("chatcmpl-") + 24
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage.completion_tokens <= 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert completion.system_fingerprint == f"millm:{MODEL_ID}@unrecorded:float32/none:transformers"
    assert raw.headers["X-miLLM-Model"] == MODEL_ID
    assert raw.headers["X-miLLM-Backend"] == "serial"
    assert raw.headers["X-miLLM-Seed"] == '7;scope="request"'
    assert raw.headers["X-miLLM-Batch"] == "1"
    assert raw.headers["X-Request-ID"].startswith("req_")
    assert "X-miLLM-Ignored-Fields" not in raw.headers


def test_a_seed_makes_sampling_repeatable(client):
    def sample(seed):
        return client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=12, temperature=1.5, seed=seed
        ).choices[0].message.content

    assert sample(11) == sample(11)
    assert len({sample(11), sample(12), sample(13)}) > 1


def test_streamed_chat_equals_the_whole_answer(client):
    whole = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    finals = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_answer_one_choice_per_prompt(client):
    completion = client.completions.create(model=MODEL_ID, prompt=["Once upon", "A long"], max_tokens=5, temperature=0)
    assert completion.object == "text_completion"
    assert [choice.index for choice in completion.choices] == [0, 1]
    assert all(choice.text for choice in completion.choices)
    single = client.completions.create(model=MODEL_ID, prompt="A long", max_tokens=5, temperature=0)
    assert single.choices[0].text == completion.choices[1].text


def test_streamed_completion_equals_the_whole_answer(client, stack):
    whole = client.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=10, temperature=0)
    # The SDK parses legacy completion chunks with its Completion type, whose finish_reason is
    # not nullable; OpenAI itself sends null until the last chunk, and so do we, since clients
    # detect the end by it. So this one stream is read without strict validation.
    lenient = make_client(stack.web.url, strict=False)
    chunks = list(lenient.completions.create(model=MODEL_ID, prompt="Once upon", max_tokens=10, temperature=0, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert [chunk.choices[0].finish_reason for chunk in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_embeddings_in_float_and_base64_agree(client):
    as_float = client.embeddings.create(model=MODEL_ID, input=["hello there", "general kenobi"], encoding_format="float")
    # The SDK asks for base64 by default and decodes it after parsing; its strict validation runs
    # first and expects a list, so the base64 answer is read raw here.
    as_base64 = client.embeddings.with_raw_response.create(model=MODEL_ID, input=["hello there", "general kenobi"])
    assert [item.index for item in as_float.data] == [0, 1]
    raw = as_base64.http_response.json()
    decoded = struct.unpack(f"<{len(as_float.data[0].embedding)}f", base64.b64decode(raw["data"][0]["embedding"]))
    assert list(decoded) == pytest.approx(as_float.data[0].embedding, abs=0)
    assert len(as_float.data[0].embedding) == 64
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens > 0
    assert as_base64.headers["X-miLLM-Model"] == MODEL_ID


def test_models_lists_the_resident_model(client):
    listed = client.models.list()
    assert MODEL_ID in [model.id for model in listed.data]
    assert client.models.retrieve(MODEL_ID).owned_by == "millm"


def test_an_unknown_model_is_404_naming_it(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert "'no-such-model'" in caught.value.message
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_non_strict_mode_reports_unused_fields_in_request_order(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "hi", "name": "ada"}],
        max_tokens=2,
        user="someone",
        extra_body={"foo": 1},
    )
    raw.parse()
    assert raw.headers["X-miLLM-Ignored-Fields"] == '"messages[0].name", "user", "foo"'


def test_strict_mode_refuses_unused_fields_naming_every_one(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": "hi", "name": "ada"}],
            max_tokens=2,
            user="someone",
            extra_headers={"X-miLLM-Strict": "true"},
        )
    assert caught.value.code == "unused_fields_refused"
    assert caught.value.param == "messages.0.name"
    assert "messages[0].name" in caught.value.message and "user" in caught.value.message


def test_a_field_the_server_cannot_honour_is_refused_in_every_mode(client):
    for strict in ("false", "true"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2, best_of=2,
                                      extra_headers={"X-miLLM-Strict": strict})
        assert caught.value.code == "field_not_honoured"
        assert caught.value.param == "best_of"
    # The neutral value changes nothing, so it is accepted.
    client.completions.create(model=MODEL_ID, prompt="x", max_tokens=2, best_of=1)


def test_n_choices_differ_repeat_with_their_seed_and_stream_by_index(client):
    answer = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=6, n=3, seed=4, temperature=1)
    texts = [choice.message.content for choice in answer.choices]
    assert [choice.index for choice in answer.choices] == [0, 1, 2] and len(set(texts)) == 3
    alone = [client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=6, seed=4 + index,
                                            temperature=1) for index in range(3)]
    assert texts == [single.choices[0].message.content for single in alone]  # choice i samples with seed + i
    assert answer.usage.prompt_tokens == alone[0].usage.prompt_tokens  # one prompt, prefilled once
    assert answer.usage.completion_tokens == sum(single.usage.completion_tokens for single in alone)
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=6, n=3, seed=4,
                                                temperature=1, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts


def token_text(client, token_id):
    """A token's text, as the server's scoring mode reports it."""
    scored = client.completions.create(model=MODEL_ID, prompt="x", max_tokens=1, logprobs=1, temperature=0,
                                       extra_body={"allowed_token_ids": [token_id]})
    return scored.choices[0].text


def test_logit_bias_forces_a_token_and_penalties_change_a_greedy_answer(client):
    forced = 1000
    for stream in (False, True):
        answer = client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=5, temperature=0,
                                                logit_bias={str(forced): 100}, stream=stream)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in answer) if stream else answer.choices[0].message.content
        assert text == token_text(client, forced) * 5, stream

    def greedy(**fields):
        return client.completions.create(model=MODEL_ID, prompt="1 2 3 4", max_tokens=12, temperature=0, **fields).choices[0].text

    plain = greedy()
    assert greedy(frequency_penalty=2) != plain
    assert greedy(presence_penalty=2) != plain
    with pytest.raises(openai.BadRequestError) as caught:
        greedy(logit_bias={"1000": 101})
    assert (caught.value.code, caught.value.param) == ("invalid_parameter", "logit_bias.1000")


def test_embeddings_refuse_dimensions(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL_ID, input="hi", dimensions=8)
    assert caught.value.code == "field_not_honoured"
    assert caught.value.param == "dimensions"


def test_a_prompt_over_the_context_is_refused_naming_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL_ID, prompt="hello " * 300, max_tokens=900)
    error = caught.value
    assert error.code == "context_length_exceeded"
    assert "1024" in error.message and "900" in error.message


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    name: str = Field(max_length=8)
    age: int
    vaccinated: bool
    friends: list[Literal["cat", "dog"]] = Field(max_length=3)


def test_parse_reads_a_pydantic_answer_for_every_seed_and_a_streamed_one_parses(client):
    # The tiny model's weights are random: the answers parse only because the grammar holds them.
    for seed in range(4):
        raw = client.chat.completions.with_raw_response.parse(
            model=MODEL_ID, messages=MESSAGES, response_format=Pet, max_tokens=120, temperature=1.0, seed=seed)
        completion = raw.parse()
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(completion.choices[0].message.parsed, Pet)
        assert raw.headers["X-miLLM-Grammar"].startswith("json_schema;sha=")
    with client.chat.completions.stream(model=MODEL_ID, messages=MESSAGES, response_format=Pet, max_tokens=120,
                                        temperature=1.0, seed=11) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Pet)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"type": "object", "not": {}}}})
    assert (caught.value.code, caught.value.param) == ("invalid_request_error", "response_format.json_schema.schema.not")


class GetWeather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    zone: str = Field(max_length=8)


def test_named_and_required_tool_calls_parse_and_a_tool_result_goes_back(client):
    # Strict function tools as the SDK writes them; random weights call validly only under the grammar.
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "function", "function": {"name": "GetWeather"}}, "required"):
        for stream in (False, True):
            if stream:
                with client.chat.completions.stream(model=MODEL_ID, messages=question, tools=tools, tool_choice=choice,
                                                    max_tokens=60, seed=2) as events:
                    completion = events.get_final_completion()
            else:
                raw = client.chat.completions.with_raw_response.parse(
                    model=MODEL_ID, messages=question, tools=tools, tool_choice=choice, max_tokens=60, seed=2)
                assert raw.headers["X-miLLM-Grammar"].startswith("tool_call;sha=")
                completion = raw.parse()
            answer = completion.choices[0]
            assert answer.finish_reason == "tool_calls", (choice, stream)
            [call] = answer.message.tool_calls
            assert isinstance(call.function.parsed_arguments, (GetWeather, GetTime))
            if isinstance(choice, dict):
                assert isinstance(call.function.parsed_arguments, GetWeather)
    followed = client.chat.completions.create(model=MODEL_ID, max_tokens=8, tools=tools, messages=[
        *question, {"role": "assistant", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}])
    assert followed.choices[0].message.content and followed.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=question, tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "Nope"}})
    assert (caught.value.code, caught.value.param) == ("invalid_request_error", "tool_choice.function.name")
