"""Function tools (issue 29, point 3) on the tiny random model: a forced call is valid only
because its grammar is enforced; `auto` reads `<tool_call>` blocks; tools and tool results reach
the prompt; and what cannot be served is a 400 naming the field."""

import json

import jsonschema
import pytest

from inference_app.engine import services
from inference_app.engine.grammars import compile_grammar
from inference_app.schemas import parse_request
from inference_app.tools import CallStream, call_format, read_calls
from millm_lib.errors import ApiError

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK, "strict": True}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": CLOCK}


def body(resident, choice, seed=0, **fields):
    return {"model": resident.model_id, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS, "tool_choice": choice, "max_tokens": 60, "temperature": 1.0, "seed": seed, **fields}


def parsed(request_body):
    return parse_request(CHAT, request_body, strict=True)


def streamed_call(resident, request_body):
    """(name, joined arguments, finish reason) of a streamed answer's tool call deltas."""
    _, chunks = services.stream(resident, parsed({**request_body, "stream": True}))
    choices = [chunk["choices"][0] for chunk in chunks if chunk["choices"]]
    calls = [call for choice in choices for call in choice["delta"].get("tool_calls", [])]
    assert all(call["index"] == 0 for call in calls) and calls[0]["id"].startswith("call_")
    assert not any(choice["delta"].get("content") for choice in choices)
    return (calls[0]["function"]["name"], "".join(call["function"].get("arguments", "") for call in calls),
            choices[-1]["finish_reason"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_is_a_valid_call_synchronous_and_streamed_alike(resident, choice, seed):
    result = services.run(resident, parsed(body(resident, choice, seed)))
    answer = result.body["choices"][0]
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
    [call] = answer["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    name = call["function"]["name"]
    if isinstance(choice, dict):
        assert name == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])
    assert result.headers["X-miLLM-Grammar"].startswith("tool_call;sha=")
    assert streamed_call(resident, body(resident, choice, seed)) == (name, call["function"]["arguments"], "tool_calls")


def test_tool_choice_none_and_no_tools_decode_text_and_auto_shows_the_tools(resident):
    plain = services.run(resident, parsed(body(resident, "none")))
    assert "tool_calls" not in plain.body["choices"][0]["message"] and "X-miLLM-Grammar" not in plain.headers
    request = parsed(body(resident, "auto")).request
    shown = resident.render_chat(request.messages, request.tools)
    assert "get_weather" in shown and "<tool_call>" in shown
    assert "get_weather" not in resident.render_chat(request.messages, [])


def test_a_call_and_its_result_come_back_into_the_prompt(resident):
    arguments = json.dumps({"city": "Paris", "unit": "c"})
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    request = parsed({"model": resident.model_id, "messages": messages, "tools": TOOLS, "max_tokens": 4}).request
    prompt = resident.render_chat(request.messages, request.tools)
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 degrees\n</tool_response>" in prompt
    answer = services.run(resident, parsed({"model": resident.model_id, "messages": messages, "tools": TOOLS,
                                            "max_tokens": 4}))
    assert answer.body["choices"][0]["finish_reason"] == "length"


def test_a_template_that_reads_tools_renders_them_itself(resident, monkeypatch):
    template = ("{% for tool in tools %}TOOL {{ tool.function.name }}; {% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
                " CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}; {% endfor %}")
    monkeypatch.setattr(resident.tokenizer, "chat_template", template)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]}]
    request = parsed({"model": resident.model_id, "messages": messages, "tools": TOOLS}).request
    assert resident.render_chat(request.messages, request.tools) == (
        "TOOL get_weather; TOOL get_time; user: hi; assistant:  CALL get_weather Oslo; ")


def test_auto_reads_tool_call_blocks_and_streams_them_whole():
    request = parse_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                   "tool_choice": "auto"}, strict=True).request
    text = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert read_calls(request, text) == ("Let me look.", [("get_time", '{"zone": "UTC"}')])
    assert read_calls(request, "<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>")[1] == []
    assert read_calls(request, "just text") == ("just text", [])
    stream = CallStream(request)
    deltas = [delta for piece in [text[:15], text[15:20], text[20:]] for delta in stream.feed(piece)] + stream.finish()
    assert "".join(delta.get("content", "") for delta in deltas) == "Let me look.\n"
    [call] = [delta["tool_calls"][0] for delta in deltas if "tool_calls" in delta]
    assert (call["index"], call["function"]) == (0, {"name": "get_time", "arguments": '{"zone": "UTC"}'})
    assert stream.called
    # A held-back partial tag that never becomes a call is text after all.
    stream = CallStream(request)
    deltas = stream.feed("a <tool") + stream.finish()
    assert "".join(delta["content"] for delta in deltas) == "a <tool" and not stream.called


def test_parameters_with_definitions_keep_their_references():
    # The SDK's pydantic_function_tool writes nested models as $defs and $refs.
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    parameters = {"type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"],
                  "additionalProperties": False, "$defs": {"Person": person}}
    tools = [{"type": "function", "function": {"name": "greet", "parameters": parameters, "strict": True}}]
    request = parse_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                   "tool_choice": "required"}, strict=True).request
    schema = call_format(request)["json_schema"]["schema"]
    assert schema["properties"]["arguments"]["properties"]["who"] == {"$ref": "#/$defs/greet.Person"}
    assert schema["$defs"] == {"greet.Person": person}


def test_a_forced_call_with_definitions_compiles(resident):
    parameters = {"type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"],
                  "additionalProperties": False, "$defs": {"Person": {
                      "type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
                      "additionalProperties": False}}}
    tools = [{"type": "function", "function": {"name": "greet", "parameters": parameters, "strict": True}}]
    answer = services.run(resident, parsed({"model": resident.model_id, "messages": [{"role": "user", "content": "hi"}],
                                            "tools": tools, "tool_choice": "required", "max_tokens": 40, "seed": 1}))
    [call] = answer.body["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)


def refusal(request_body):
    with pytest.raises(ApiError) as caught:
        parse_request(CHAT, request_body, strict=True, param_prefix="body.")
    return caught.value


BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fields,param,words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "body.tool_choice.function.name", "'nope' is not one of the tools"),
    ({"tool_choice": "required"}, "body.tool_choice", "needs at least one tool"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "body.tools.1.function.name", "used by two tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": [], "additionalProperties": False}}}]},
     "body.tools.0.function.parameters.required", "'a' is not listed"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]},
     "body.tools.0.function.parameters.not", "outside the JSON Schema subset"),
    ({"messages": [{"role": "tool", "content": "18"}]}, "body.messages.0.tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "user"}]}, "body.messages.0.content", "content is required"),
    ({"tools": [TOOLS[0]] * 129}, "body.tools", "over the limit of 128"),
])
def test_tools_that_cannot_be_served_are_400_naming_the_field(fields, param, words):
    error = refusal({**BASE, **fields})
    assert (error.status, error.param) == (400, param)
    assert words in error.message


def test_a_bad_tool_shape_and_scoring_with_a_forced_call_are_refused():
    error = refusal({**BASE, "tools": [{"type": "web_search"}]})
    assert error.param.startswith("body.tools.0")
    error = refusal({**BASE, "tools": [{"type": "function", "function": {"name": "bad name"}}]})
    assert error.param == "body.tools.0.function.name"
    error = refusal({**BASE, "tools": TOOLS, "tool_choice": "sometimes"})
    assert error.param == "body.tool_choice" and "'none', 'auto' or 'required'" in error.message
    error = refusal({**BASE, "tools": TOOLS, "tool_choice": "required", "logprobs": True, "max_tokens": 1})
    assert (error.code, error.param) == ("field_not_honoured", "body.tool_choice")


def test_a_tool_schema_the_grammar_cannot_build_is_400_naming_tools(resident):
    parameters = {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}, "required": ["a"],
                  "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}]
    request = parsed({"model": resident.model_id, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                      "tool_choice": "required"})
    with pytest.raises(ApiError) as caught:
        compile_grammar(resident, call_format(request.request), "tools")
    assert (caught.value.status, caught.value.param) == (400, "tools")
    with pytest.raises(ApiError):
        services.stream(resident, request)
