"""A chat completion's answer as a Responses API response object (`from_chat`) and as its stream
of events (`EventStream`), checked against the openai SDK's own types. Chat answers are written
by hand: no model, no engine."""

import json
import time
import typing

import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from inference_app.schemas import parse_request
from millm_lib.errors import ApiError
from millm_lib.limits import RESPONSES
from responses_app.answers import EventStream, from_chat
from responses_app.rows import row_answer, row_usage

EVENTS = TypeAdapter(ResponseStreamEvent)
# The SDK's event class for each type (its union is discriminated by `type`, but pydantic does
# not know it: validating against the class itself names the real error).
EVENT_CLASSES = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
                 for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
USAGE = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}


def request(**fields):
    return parse_request(RESPONSES, {"model": "m", "input": "hi", **fields}, strict=True).request


def chat(content, finish_reason="stop", tool_calls=None, usage=USAGE, model="tiny-llama"):
    message = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}], "usage": usage}


def a_call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def answered(asked, chat_body, **options):
    """The response object, as it goes on the wire, and as the SDK reads it."""
    answer = json.loads(json.dumps(from_chat(asked, "resp_test", chat_body, int(time.time()), **options)))
    return answer, SdkResponse.model_validate(answer)


def test_a_text_answer_is_a_completed_response_with_one_message():
    answer, sdk = answered(request(), chat("Hello there."))
    assert (answer["id"], answer["object"], answer["status"], answer["model"]) == (
        "resp_test", "response", "completed", "tiny-llama")
    assert answer["error"] is None and answer["incomplete_details"] is None and answer["completed_at"] is not None
    [item] = answer["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["id"].startswith("msg_")
    assert item["content"] == [{"type": "output_text", "text": "Hello there.", "annotations": [], "logprobs": []}]
    assert sdk.output_text == "Hello there."
    assert answer["usage"]["input_tokens"] == 11 and answer["usage"]["output_tokens"] == 4
    assert answer["usage"]["total_tokens"] == 15
    assert (sdk.usage.input_tokens, sdk.usage.output_tokens, sdk.usage.total_tokens) == (11, 4, 15)


def test_a_length_stop_is_an_incomplete_response():
    answer, sdk = answered(request(max_output_tokens=4), chat("Hello th", "length"))
    assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["output"][0]["status"] == "incomplete" and answer["max_output_tokens"] == 4
    assert sdk.status == "incomplete" and sdk.incomplete_details.reason == "max_output_tokens"
    assert sdk.output_text == "Hello th"


def test_tool_calls_without_content_are_function_call_items_only():
    calls = [a_call("call_a", "weather", '{"city":"Paris"}'), a_call("call_b", "time", '{"zone":"UTC"}')]
    answer, sdk = answered(request(tools=[{"type": "function", "name": "weather"}, {"type": "function", "name": "time"}]),
                           chat(None, "tool_calls", calls))
    assert answer["status"] == "completed"
    assert [item["type"] for item in answer["output"]] == ["function_call", "function_call"]
    first, second = answer["output"]
    assert first["id"].startswith("fc_") and first["id"] != second["id"]
    assert (first["call_id"], first["name"], first["arguments"], first["status"]) == (
        "call_a", "weather", '{"city":"Paris"}', "completed")
    assert (second["call_id"], second["name"], second["arguments"]) == ("call_b", "time", '{"zone":"UTC"}')
    assert sdk.output_text == "" and [item.call_id for item in sdk.output] == ["call_a", "call_b"]


def test_text_before_a_call_is_a_message_then_the_call():
    answer, sdk = answered(request(tools=[{"type": "function", "name": "f"}]),
                           chat("Let me look.", "tool_calls", [a_call("call_1", "f", "{}")]))
    assert [item["type"] for item in answer["output"]] == ["message", "function_call"]
    assert sdk.output_text == "Let me look."
    empty, _ = answered(request(tools=[{"type": "function", "name": "f"}]),
                        chat("", "tool_calls", [a_call("call_1", "f", "{}")]))
    assert [item["type"] for item in empty["output"]] == ["function_call"]  # "" beside a call: no message


def test_an_empty_answer_is_an_empty_message():
    answer, sdk = answered(request(), chat("", "stop"))
    assert [item["type"] for item in answer["output"]] == ["message"] and sdk.output_text == ""


def test_the_response_repeats_the_requests_settings():
    fmt = {"type": "json_schema", "name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}}
    asked = request(instructions="sys", temperature=0.5, top_p=0.5, metadata={"k": "v"}, user="u", text={"format": fmt},
                    tools=[{"type": "function", "name": "f", "description": "d"}],
                    tool_choice={"type": "function", "name": "f"}, store=False, previous_response_id="resp_prev")
    answer, sdk = answered(asked, chat(None, "tool_calls", [a_call("call_1", "f", "{}")]))
    assert (answer["instructions"], answer["temperature"], answer["top_p"], answer["metadata"], answer["user"]) == (
        "sys", 0.5, 0.5, {"k": "v"}, "u")
    assert answer["text"] == {"format": fmt} and answer["store"] is False
    assert answer["previous_response_id"] == "resp_prev"
    assert answer["tool_choice"] == {"type": "function", "name": "f"}
    assert answer["tools"] == [{"type": "function", "name": "f", "description": "d", "parameters": None,
                                "strict": None}]
    assert sdk.tool_choice.name == "f" and sdk.tools[0].name == "f"
    defaults, _ = answered(request(), chat("x"))
    assert (defaults["tool_choice"], defaults["tools"], defaults["text"], defaults["store"]) == (
        "auto", [], {"format": {"type": "text"}}, True)
    assert answered(request(), chat("x"), store=False)[0]["store"] is False  # a batch row not kept


def test_a_batch_rows_answer_is_kept_only_when_the_row_asks():
    answer, kept = row_answer(request(), chat("x"))
    assert kept is None and answer["store"] is False and answer["id"].startswith("resp_")
    answer, kept = row_answer(request(store=True), chat("x"))
    assert answer["store"] is True and [item["type"] for item in kept] == ["message"]
    assert row_usage(answer) == {"prompt_tokens": 11, "completion_tokens": 4}


# --- the stream ---


def chunk(delta=None, finish_reason=None, usage=None):
    choices = [] if delta is None and finish_reason is None else [
        {"index": 0, "delta": delta or {}, "finish_reason": finish_reason}]
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny-llama",
            "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def on_the_wire(events):
    """Events as the route sends them: each serialised as it is made (views._sse)."""
    return [json.loads(json.dumps(event)) for event in events]


def streamed(asked, chunks, end="finish", error=None):
    stream = EventStream(asked, "resp_stream", "tiny-llama")
    events = on_the_wire(stream.start())
    for piece in chunks:
        events += on_the_wire(stream.feed(piece))
    events += on_the_wire(stream.finish() if end == "finish" else stream.fail(error))
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    for event in events:  # each one as the SDK types it
        if event["type"] == "response.failed":  # the SDK lists OpenAI's own error codes; this server sends its own
            event = {**event, "response": {**event["response"], "error": {**event["response"]["error"],
                                                                          "code": "server_error"}}}
        EVENT_CLASSES[event["type"]].model_validate(event)
        EVENTS.validate_python(event)
    return events


def kinds(events):
    return [event["type"].removeprefix("response.") for event in events]


TEXT_CHUNKS = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo, "}),
               chunk({"content": "world"}), chunk({}, "stop"), chunk(usage=USAGE)]


def test_a_streamed_text_answer_is_the_responses_events_in_order():
    events = streamed(request(stream=True), TEXT_CHUNKS)
    assert kinds(events) == ["created", "in_progress", "output_item.added", "content_part.added",
                             "output_text.delta", "output_text.delta", "output_text.delta", "output_text.done",
                             "content_part.done", "output_item.done", "completed"]
    for opening in events[:2]:
        assert opening["response"]["status"] == "in_progress" and opening["response"]["output"] == []
        assert opening["response"]["id"] == "resp_stream"
    added = events[2]
    assert added["item"]["type"] == "message" and added["item"]["status"] == "in_progress"
    assert added["item"]["content"] == []
    item_id = added["item"]["id"]
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert all(event["item_id"] == item_id and event["output_index"] == 0 for event in deltas)
    text = "".join(event["delta"] for event in deltas)
    assert text == "Hello, world"
    assert events[7]["text"] == text and events[8]["part"]["text"] == text
    assert events[9]["item"]["status"] == "completed" and events[9]["item"]["content"][0]["text"] == text
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["completed_at"] is not None
    sdk = SdkResponse.model_validate(final)
    assert sdk.output_text == text and sdk.output[0].id == item_id
    assert (sdk.usage.input_tokens, sdk.usage.output_tokens, sdk.usage.total_tokens) == (11, 4, 15)


def test_a_streamed_call_is_function_call_events():
    chunks = [chunk({"role": "assistant", "content": ""}),
              chunk({"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
              chunk({}, "tool_calls"), chunk(usage=USAGE)]
    events = streamed(request(stream=True, tools=[{"type": "function", "name": "f"}]), chunks)
    assert kinds(events) == ["created", "in_progress", "output_item.added", "function_call_arguments.delta",
                             "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
                             "completed"]
    added = events[2]["item"]
    assert (added["type"], added["call_id"], added["name"], added["arguments"], added["status"]) == (
        "function_call", "call_x", "f", "", "in_progress")
    assert [event["delta"] for event in events[3:5]] == ['{"a": ', "1}"]
    assert all(event["item_id"] == added["id"] for event in events[3:6]) and events[6]["item"]["id"] == added["id"]
    assert events[5]["arguments"] == '{"a": 1}'
    assert events[6]["item"]["arguments"] == '{"a": 1}' and events[6]["item"]["status"] == "completed"
    final = SdkResponse.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output_text == ""
    [call] = final.output
    assert (call.type, call.call_id, call.name, call.arguments) == ("function_call", "call_x", "f", '{"a": 1}')


def test_text_then_a_call_closes_the_message_before_the_call():
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Checking."}),
              chunk({"tool_calls": [{"index": 0, "id": "call_y", "type": "function",
                                     "function": {"name": "g", "arguments": "{}"}}]}),
              chunk({}, "tool_calls"), chunk(usage=USAGE)]
    events = streamed(request(stream=True, tools=[{"type": "function", "name": "g"}]), chunks)
    assert kinds(events) == ["created", "in_progress", "output_item.added", "content_part.added", "output_text.delta",
                             "output_text.done", "content_part.done", "output_item.done", "output_item.added",
                             "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
                             "completed"]
    assert [events[i]["output_index"] for i in (2, 7, 8, 11)] == [0, 0, 1, 1]
    final = SdkResponse.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["message", "function_call"] and final.output_text == "Checking."


def test_a_length_stop_ends_the_stream_incomplete():
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({}, "length"),
              chunk(usage=USAGE)]
    events = streamed(request(stream=True, max_output_tokens=1), chunks)
    assert kinds(events)[-1] == "incomplete" and "completed" not in kinds(events)
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"
    assert SdkResponse.model_validate(final).output_text == "Hel"


def test_an_empty_stream_is_an_empty_message():
    events = streamed(request(stream=True), [chunk({"role": "assistant", "content": ""}), chunk({}, "stop")])
    assert kinds(events) == ["created", "in_progress", "output_item.added", "content_part.added",
                             "output_text.done", "content_part.done", "output_item.done", "completed"]
    assert SdkResponse.model_validate(events[-1]["response"]).output_text == ""


def test_a_failure_mid_stream_is_response_failed_with_the_error():
    chunks = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"})]
    events = streamed(request(stream=True), chunks, end="fail",
                      error=ApiError(503, "engine_unavailable", "The engine went away"))
    assert kinds(events) == ["created", "in_progress", "output_item.added", "content_part.added",
                             "output_text.delta", "failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["completed_at"] is None
    # One of the Responses API's own codes, which the SDK's type allows; this server's leads the message.
    assert failed["error"] == {"code": "server_error", "message": "engine_unavailable: The engine went away"}
    sdk = SdkResponse.model_validate(failed)
    assert sdk.status == "failed" and sdk.error.code == "server_error"


@pytest.mark.parametrize("pieces", [["a"], ["a", "b", "c"], ["héllo", " wörld", "!"]])
def test_the_joined_deltas_are_the_final_text(pieces):
    chunks = [chunk({"role": "assistant", "content": ""}), *(chunk({"content": piece}) for piece in pieces),
              chunk({}, "stop"), chunk(usage=USAGE)]
    events = streamed(request(stream=True), chunks)
    joined = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert joined == "".join(pieces) == SdkResponse.model_validate(events[-1]["response"]).output_text
