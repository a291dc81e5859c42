"""The body of POST /v1/responses, parsed as the route parses it (inference_app.schemas with the
schema responses_app registers at start-up), and the chat completion request it is served as.
No model, no engine, no database."""

import time

import pytest
from openai.types.responses import Response as SdkResponse

from inference_app.schemas import parse_request
from millm_lib.errors import ApiError
from millm_lib.limits import CHAT, RESPONSES
from responses_app.answers import from_chat
from responses_app.requests import REFUSED, ResponseRequest, rename, renamed

BASE = {"model": "m", "input": "hi"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}


def parse(body, strict=True, prefix=""):
    return parse_request(RESPONSES, body, strict, prefix)


def request(**fields):
    return parse({**BASE, **fields}).request


def refused(body, strict=True, prefix=""):
    with pytest.raises(ApiError) as caught:
        parse(body, strict, prefix)
    return caught.value


def test_the_app_registers_its_schema():
    parsed = parse(BASE)
    assert parsed.endpoint == RESPONSES and isinstance(parsed.request, ResponseRequest) and parsed.ignored == []


def test_a_string_input_is_one_user_message():
    body = request().chat_body([])
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "top_p": 1.0}
    parse_request(CHAT, body, strict=True)  # what the engine is sent is a valid chat request


def test_instructions_are_the_first_system_message():
    messages = request(instructions="Be brief.", input=[{"role": "user", "content": "a"},
                                                        {"role": "assistant", "content": "b"}]).chat_body([])["messages"]
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"}]


def test_content_parts_are_joined_into_the_message_text():
    messages = request(input=[{"type": "message", "role": "developer", "content": [
        {"type": "input_text", "text": "one "}, {"type": "input_text", "text": "two"}]}]).chat_body([])["messages"]
    assert messages == [{"role": "developer", "content": "one two"}]


def test_function_calls_and_their_outputs_become_an_assistant_turn_and_tool_messages():
    asked = request(input=[
        {"role": "user", "content": "weather in Paris and Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "1"},
                                                                          {"type": "input_text", "text": "2"}]},
    ])
    messages = asked.chat_body([])["messages"]
    assert messages == [
        {"role": "user", "content": "weather in Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [  # both calls join ONE assistant message
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18"},
        {"role": "tool", "tool_call_id": "call_2", "content": "12"},
    ]


def test_a_call_after_a_tool_message_starts_a_new_assistant_message():
    messages = request(input=[
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
    ]).chat_body([])["messages"]
    assert [message["role"] for message in messages] == ["user", "assistant", "tool", "assistant"]
    assert [len(message.get("tool_calls", [])) for message in messages] == [0, 1, 0, 1]


def test_the_context_comes_after_the_instructions_and_before_the_input():
    earlier = request(input="first question")
    answer = from_chat(earlier, "resp_1", {"model": "m", "choices": [{"message": {
        "role": "assistant", "content": "first answer"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}, int(time.time()))
    context = [*earlier.input_items(), *answer["output"]]  # what a stored response's conversation() gives
    messages = request(instructions="sys", input="second question").chat_body(context)["messages"]
    assert messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "first question"},
                        {"role": "assistant", "content": "first answer"}, {"role": "user", "content": "second question"}]


def test_a_json_schema_text_format_is_chats_response_format():
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    body = request(text={"format": fmt}).chat_body([])
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    assert request(text={"format": {"type": "json_object"}}).chat_body([])["response_format"] == {"type": "json_object"}
    assert "response_format" not in request(text={}).chat_body([])


def test_tools_are_chat_function_tools_and_a_named_choice_is_chats():
    tool = {"type": "function", "name": "f", "description": "does f", "parameters": SCHEMA, "strict": True}
    body = request(tools=[tool, {"type": "function", "name": "g"}], tool_choice={"type": "function", "name": "f"},
                   parallel_tool_calls=False).chat_body([])
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "description": "does f", "parameters": SCHEMA, "strict": True}},
        {"type": "function", "function": {"name": "g"}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False
    assert request(tools=[tool], tool_choice="required").chat_body([])["tool_choice"] == "required"
    assert "tools" not in request().chat_body([]) and "tool_choice" not in request().chat_body([])


def test_settings_become_chats():
    body = request(max_output_tokens=7, temperature=0.5, top_p=0.9, seed=3).chat_body([])
    assert (body["max_completion_tokens"], body["temperature"], body["top_p"], body["seed"]) == (7, 0.5, 0.9, 3)
    assert "max_tokens" not in body and "max_output_tokens" not in body
    assert request(max_output_tokens=7).chat_request().request.max_completion_tokens == 7


@pytest.mark.parametrize("fields,param,code", [
    ({"text": {"format": {"type": "json_schema", "name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}},
     "text.format.schema.additionalProperties", None),
    ({"tools": [{"type": "function", "name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": [], "additionalProperties": False}}]},
     "tools.0.parameters.required", None),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools.1.name", None),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "field_not_honoured"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "file_search"}]}, "tools.1.type", "field_not_honoured"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0.type", "field_not_honoured"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "input_text", "text": "b"}, {"type": "input_file", "file_id": "file_1"}]}]},
     "input.1.content.1.type", "field_not_honoured"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "field_not_honoured"),
    ({"background": True}, "background", "field_not_honoured"),
    ({"conversation": "conv_1"}, "conversation", "field_not_honoured"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
     "input.0.content.0.type", "invalid_parameter"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_parameter"),
])
def test_what_cannot_be_served_is_a_400_naming_the_responses_field(fields, param, code):
    for prefix in ("", "body."):  # the route's names, and a batch line's
        error = refused({**BASE, **fields}, prefix=prefix)
        assert (error.status, error.param) == (400, prefix + param), error.message
        assert f"'{prefix}{param}'" in error.message  # quoted as the param names it
        assert "'response_format" not in error.message and "'messages" not in error.message
        assert "'body.response_format" not in error.message and "'body.messages" not in error.message
        assert "function.name" not in error.param and "json_schema" not in error.param
        if code is not None:
            assert error.code == code


def test_background_false_is_honoured():
    assert parse({**BASE, "background": False}).request.background is False


def test_strict_mode_refuses_an_unknown_key_and_lenient_mode_reports_it():
    error = refused({**BASE, "frobnicate": 1})
    assert (error.status, error.code, error.param) == (400, "unused_fields_refused", "frobnicate")
    assert parse({**BASE, "frobnicate": 1}, strict=False).ignored == ["frobnicate"]
    nested = {**BASE, "input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "extra": 1}]}]}
    assert refused(nested).param == "input.0.content.0.extra"
    assert parse(nested, strict=False).ignored == ["input[0].content[0].extra"]
    assert refused({**BASE, "tools": [{"type": "function", "name": "f", "foo": 1}]}).param == "tools.0.foo"


def test_the_sdks_echoed_output_items_are_accepted_in_strict_mode():
    echoed = [
        {"role": "user", "content": "hi"},
        {"id": "msg_abc", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}]},
        {"id": "fc_abc", "type": "function_call", "status": "completed", "call_id": "call_1", "name": "f",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"},
    ]
    messages = parse({**BASE, "input": echoed}, strict=True).request.chat_body([])["messages"]
    assert messages == [  # the assistant's text and its call: one turn
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]


def test_a_response_the_sdk_parsed_can_be_sent_back_as_input():
    """`input=[*previous.output, ...]` as the SDK serialises it (model_dump, exclude_unset)."""
    earlier = request(tools=[{"type": "function", "name": "f"}])
    answer = from_chat(earlier, "resp_1", {"model": "m", "choices": [{"message": {
        "role": "assistant", "content": "let me check", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]},
        "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
        int(time.time()))
    sent = [item.model_dump(exclude_unset=True, mode="json") for item in SdkResponse.model_validate(answer).output]
    body = {**BASE, "tools": [{"type": "function", "name": "f"}],
            "input": [{"role": "user", "content": "hi"}, *sent,
                      {"type": "function_call_output", "call_id": "call_9", "output": "42"}]}
    messages = parse(body, strict=True).request.chat_body([])["messages"]
    # The answer's text and its call are one assistant turn again, as the chat answer had them.
    assert messages[1:] == [
        {"role": "assistant", "content": "let me check",
         "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "42"}]


def test_input_items_give_each_item_an_id_and_a_status():
    [item] = request().input_items()
    assert item["id"].startswith("msg_") and item["status"] == "completed"
    assert (item["type"], item["role"], item["content"]) == ("message", "user", [{"type": "input_text", "text": "hi"}])
    items = request(input=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "r"},
        {"type": "message", "role": "assistant", "id": "msg_mine", "status": "incomplete",
         "content": [{"type": "output_text", "text": "t", "annotations": [], "logprobs": []}]},
    ]).input_items()
    assert [item["type"] for item in items] == ["message", "message", "function_call", "function_call_output", "message"]
    assert [item["id"][:item["id"].index("_") + 1] for item in items] == ["msg_", "msg_", "fc_", "fco_", "msg_"]
    assert items[4]["id"] == "msg_mine" and items[4]["status"] == "incomplete"  # an echoed item keeps its own
    assert all(item["status"] == "completed" for item in items[:4])
    assert len({item["id"] for item in items}) == 5
    assert items[1]["content"] == [{"type": "output_text", "text": "a", "annotations": []}]
    assert items[2] | {"id": None} == {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                                       "id": None, "status": "completed"}
    # and they read back as the same chat messages (a chained response's context)
    again = request(input="next")
    assert again.chat_body(items[:4])["messages"][:-1] == request(input=items[:4]).chat_body([])["messages"]


def test_renamed_names_this_bodys_fields():
    error = renamed(ApiError(400, "invalid_parameter", "Invalid value for 'messages': something", param="messages"),
                    "body.")
    assert (error.status, error.code, error.param) == (400, "invalid_parameter", "body.input")
    assert error.message == "Invalid value for 'body.input': something"
    error = renamed(ApiError(400, "invalid_request_error", "Invalid value for 'tools.2.function.parameters.type': x",
                             param="tools.2.function.parameters.type"))
    assert error.param == "tools.2.parameters.type" and "'tools.2.parameters.type'" in error.message
    assert renamed(ApiError(500, "engine_failed", "boom")).param is None
    assert rename("response_format.json_schema.schema.properties") == "text.format.schema.properties"
    assert rename("response_format") == "text.format"
    assert rename("max_completion_tokens") == "max_output_tokens"
    assert rename("tool_choice.function.name") == "tool_choice.name"
    assert rename("messages.3.content") == "input"
