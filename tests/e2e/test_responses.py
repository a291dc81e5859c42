"""The Responses API (issue 30) through the openai SDK, with strict response validation, against
real web and engine processes on the tiny random model: created, stored, chained, streamed,
parsed, calling a function, refused, and as a batch endpoint."""

import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.batch_helpers import read_jsonl, start_batch, wait_for
from tests.e2e.batch_helpers import line as batch_line
from tests.e2e.conftest import MODEL_ID
from tests.e2e.metrics_helpers import scrape, value

RESPONSES = "/v1/responses"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
           "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": WEATHER, "strict": True}


def test_a_response_is_created_retrieved_and_deleted_and_store_false_keeps_nothing(stack, client):
    before = scrape(stack)
    raw = client.responses.with_raw_response.create(model=MODEL_ID, input="Say something.", max_output_tokens=8,
                                                    metadata={"job": "one"}, extra_body={"seed": 3})
    response = raw.parse()
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.model == MODEL_ID
    assert response.output[0].type == "message" and response.output[0].id.startswith("msg_")
    assert response.output_text == response.output[0].content[0].text
    assert 0 < response.usage.output_tokens <= 8
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.metadata, response.store, response.max_output_tokens) == ({"job": "one"}, True, 8)
    assert raw.headers["X-miLLM-Model"] == MODEL_ID and raw.headers["X-miLLM-Seed"] == '3;scope="request"'
    counted = value(scrape(stack), "millm_responses_total", status=response.status)
    assert counted == value(before, "millm_responses_total", status=response.status) + 1  # /metrics counts by status

    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    items = list(client.responses.input_items.list(response.id))
    assert [(item.type, item.role, item.content[0].text) for item in items] == [("message", "user", "Say something.")]
    deleted = client.responses.delete(response.id)  # the SDK answers None for a delete
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)

    unstored = client.responses.create(model=MODEL_ID, input="Say something.", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model=MODEL_ID, input="More.", previous_response_id=unstored.id)
    assert refused.value.body["param"] == "previous_response_id"


def test_a_response_says_what_chat_says_for_the_same_prompt(client):
    instructions, ask = "Answer briefly.", "Name a colour."
    response = client.responses.with_raw_response.create(model=MODEL_ID, instructions=instructions, input=ask,
                                                         max_output_tokens=12, temperature=0)
    chat = client.chat.completions.with_raw_response.create(
        model=MODEL_ID, max_completion_tokens=12, temperature=0,
        messages=[{"role": "system", "content": instructions}, {"role": "user", "content": ask}])
    answer, completion = response.parse(), chat.parse()
    assert answer.output_text == completion.choices[0].message.content
    assert answer.instructions == instructions
    assert answer.usage.input_tokens == completion.usage.prompt_tokens
    assert answer.usage.output_tokens == completion.usage.completion_tokens
    for name in ("X-miLLM-Model", "X-miLLM-Backend", "X-miLLM-Batch"):
        assert response.headers[name] == chat.headers[name]


def test_a_chain_grows_its_input_and_lists_every_item_it_read(client):
    first = client.responses.create(model=MODEL_ID, input="Pick a number.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model=MODEL_ID, input="And another.", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    third = client.responses.create(model=MODEL_ID, input="One more.", previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens
    assert third.previous_response_id == second.id
    newest_first = [item for item in client.responses.input_items.list(third.id)]
    texts = [item.content[0].text for item in reversed(newest_first)]
    assert texts == ["Pick a number.", first.output_text, "And another.", second.output_text, "One more."]
    # Paged one at a time, oldest first, the SDK's cursor walks the same items.
    paged = [item.id for item in client.responses.input_items.list(third.id, limit=1, order="asc")]
    assert paged == [item.id for item in reversed(newest_first)]
    # Deleting an ancestor breaks nothing: a stored response keeps its whole conversation.
    client.responses.delete(first.id)
    fourth = client.responses.create(model=MODEL_ID, input="Last.", previous_response_id=third.id, max_output_tokens=2)
    assert fourth.usage.input_tokens > third.usage.input_tokens


def test_streamed_events_come_in_order_and_their_deltas_make_the_answer(client):
    whole = client.responses.create(model=MODEL_ID, input="Tell a story.", max_output_tokens=16, temperature=0)
    with client.responses.stream(model=MODEL_ID, input="Tell a story.", max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    # Cut at max_output_tokens, a stream ends response.incomplete, as OpenAI's do.
    closing = f"response.{whole.status}"
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", closing]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text  # kept once it ended


def test_a_streamed_function_call_sends_its_arguments_in_pieces(client):
    with client.responses.stream(model=MODEL_ID, input="Weather in Oslo?", tools=[WEATHER_TOOL],
                                 tool_choice="required", max_output_tokens=60, extra_body={"seed": 2}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    pieces = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert len(pieces) > 1
    call = final.output[0]
    assert call.type == "function_call" and "".join(pieces) == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER)


class Pet(BaseModel):
    kind: str = Field(max_length=8)
    age: int
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=2)


def test_parse_with_a_pydantic_text_format_gives_typed_answers_for_several_seeds(client):
    for seed in (1, 2, 3):
        parsed = client.responses.parse(model=MODEL_ID, input="Describe a pet.", text_format=Pet, extra_body={"seed": seed},
                                        max_output_tokens=120, temperature=1.0)
        assert isinstance(parsed.output_parsed, Pet), parsed.output_text
    raw = client.responses.with_raw_response.create(
        model=MODEL_ID, input="Describe a pet.", max_output_tokens=120, extra_body={"seed": 1},
        text={"format": {"type": "json_schema", "name": "pet", "schema": Pet.model_json_schema() | {
            "additionalProperties": False, "required": ["kind", "age", "tags"]}, "strict": True}})
    assert raw.headers["X-miLLM-Grammar"].startswith("json_schema;sha=")


def test_a_required_function_call_and_its_output_sent_back(client):
    called = client.responses.create(model=MODEL_ID, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                     tool_choice="required", max_output_tokens=60, extra_body={"seed": 5})
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and called.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answered = client.responses.create(
        model=MODEL_ID, previous_response_id=called.id, tools=[WEATHER_TOOL], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert answered.output[0].type == "message" and answered.usage.input_tokens > called.usage.input_tokens
    # The call can also travel back by hand, as the SDK's own output items, with no stored chain.
    by_hand = client.responses.create(
        model=MODEL_ID, tools=[WEATHER_TOOL], max_output_tokens=8, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris?"}, *called.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}])
    assert by_hand.usage.input_tokens == answered.usage.input_tokens


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "strict": True,
                                        "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}},
     "text.format.schema.additionalProperties"),
    ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(stack, body, param):
    answer = httpx.post(stack.web.url + RESPONSES, json={"model": MODEL_ID, **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and f"'{param}'" in error["message"], error


def test_a_responses_batch_answers_response_objects_in_input_order(client):
    rows = [batch_line(f"row-{index}", RESPONSES, {"model": MODEL_ID, "input": f"Item {index}:", "seed": index,
                                                   "max_output_tokens": 6}) for index in range(3)]
    rows.append(batch_line("pet", RESPONSES, {"model": MODEL_ID, "input": "Describe a pet.", "max_output_tokens": 80,
                                              "store": True, "text": {"format": {
                                                  "type": "json_schema", "name": "w", "schema": WEATHER,
                                                  "strict": True}}}))
    batch = wait_for(client, start_batch(client, rows, RESPONSES).id)
    assert (batch.status, batch.request_counts.completed) == ("completed", 4)
    lines = read_jsonl(client, batch.output_file_id)
    assert [entry["custom_id"] for entry in lines] == ["row-0", "row-1", "row-2", "pet"]
    for entry in lines:
        parsed = openai.types.responses.Response.model_validate(entry["response"]["body"])
        assert parsed.object == "response" and parsed.usage.output_tokens > 0
    alone = client.responses.create(model=MODEL_ID, input="Item 1:", max_output_tokens=6, store=False,
                                    extra_body={"seed": 1})
    assert lines[1]["response"]["body"]["output"][0]["content"][0]["text"] == alone.output_text
    stored = lines[3]["response"]["body"]
    jsonschema.validate(json.loads(stored["output"][0]["content"][0]["text"]), WEATHER)
    assert (lines[0]["response"]["body"]["store"], stored["store"]) == (False, True)
    assert client.responses.retrieve(stored["id"]).output_text == stored["output"][0]["content"][0]["text"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(lines[0]["response"]["body"]["id"])
    assert batch.usage.input_tokens == sum(entry["response"]["body"]["usage"]["input_tokens"] for entry in lines)
