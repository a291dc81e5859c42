"""Structured outputs (issue 29, point 1) on the tiny random model: an answer is valid only
because the grammar is enforced token by token, in both decoding loops, streamed and seeded;
and what the schema subset leaves out is a 400 naming its path."""

import json
import threading

import jsonschema
import pytest

from inference_app.engine import services
from inference_app.engine.scheduler import SeatedRuntime, StepScheduler
from inference_app.schemas import parse_request
from millm_lib.errors import ApiError
from tests.inference.test_scheduler import alone

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Every keyword of the strict subset: nested objects, arrays, enums, anyOf, $defs/$ref, const.
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "bird"]},
        "count": {"type": "integer"},
        "ok": {"type": "boolean"},
        "owner": {"$ref": "#/$defs/person"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "note": {"anyOf": [{"type": "null"}, {"const": "none"}]},
    },
    "required": ["kind", "count", "ok", "owner", "tags", "note"],
    "additionalProperties": False,
    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                          "age": {"type": "integer"}},
                         "required": ["name", "age"], "additionalProperties": False}},
}


def schema_format(schema=SCHEMA, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def chat_body(resident, seed, response_format=None, **fields):
    return {"model": resident.model_id, "messages": [{"role": "user", "content": "Describe a pet."}],
            "max_tokens": 120, "temperature": 1.0, "seed": seed, "response_format": response_format or schema_format(),
            **fields}


def answer(resident, body, endpoint=CHAT):
    return services.run(resident, parse_request(endpoint, body, strict=True))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_random_model_answers_in_the_schema_and_says_so(resident, seed):
    result = answer(resident, chat_body(resident, seed))
    choice = result.body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert list(json.loads(choice["message"]["content"])) == list(SCHEMA["properties"])  # the schema's order
    kind, sha = result.headers["X-miLLM-Grammar"].split(";sha=")
    assert kind == "json_schema" and len(sha) == 12
    unconstrained = answer(resident, chat_body(resident, seed, {"type": "text"}))
    assert "X-miLLM-Grammar" not in unconstrained.headers


def test_seeded_constrained_answers_repeat_and_a_stream_joins_to_the_same_answer(resident):
    first = answer(resident, chat_body(resident, 5)).body["choices"][0]["message"]["content"]
    assert answer(resident, chat_body(resident, 5)).body["choices"][0]["message"]["content"] == first
    headers, chunks = services.stream(resident, parse_request(CHAT, chat_body(resident, 5, stream=True), strict=True))
    assert headers["X-miLLM-Grammar"].startswith("json_schema;sha=")
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"]) == first


def test_completions_take_a_schema_too(resident):
    body = {"model": resident.model_id, "prompt": "Pet:", "max_tokens": 120, "temperature": 1.0, "seed": 9,
            "response_format": schema_format()}
    jsonschema.validate(json.loads(answer(resident, body, COMPLETIONS).body["choices"][0]["text"]), SCHEMA)


def test_in_a_shared_step_each_row_keeps_its_own_grammar_and_a_plain_row_is_untouched(resident):
    scheduler = StepScheduler(prefill_tokens_per_step=4096)
    rows = [parse_request(CHAT, chat_body(resident, seed), strict=True) for seed in (1, 2)]
    results, shared = [None, None, None], []

    def constrained(index, parsed):
        seated = SeatedRuntime(resident, scheduler, interactive=True)
        results[index] = services.run(seated, parsed).body["choices"][0]["message"]["content"]
        shared.append(seated.shared)

    def plain():
        seated = SeatedRuntime(resident, scheduler, interactive=True)
        results[2] = [token.token_id for token in seated.generate(resident.encode("Hello there"), 12, 0.0, 1.0, None)]

    threads = [threading.Thread(target=constrained, args=(index, parsed)) for index, parsed in enumerate(rows)]
    threads.append(threading.Thread(target=plain))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for index in (0, 1):
        jsonschema.validate(json.loads(results[index]), SCHEMA)
        assert results[index] == answer(resident, chat_body(resident, index + 1)).body["choices"][0]["message"]["content"]
    assert results[2] == alone(resident, "Hello there", 12)
    assert any(shared)  # the rows decoded in shared steps


def test_json_object_answers_parse_whenever_they_finish(resident):
    """Random weights under the json_object grammar: every answer that ends (finish "stop") is
    one JSON object; one cut by max_tokens still opens one. Random weights rarely close what they
    open, so a logit_bias toward the closing characters lets most answers end (the grammar still
    decides where they may)."""
    closing = {str(resident.encode(text)[-1]): 8 for text in ("}", '"', "]")}
    finished = 0
    for seed in range(6):
        body = chat_body(resident, seed, {"type": "json_object"}, max_tokens=160, logit_bias=closing)
        choice = answer(resident, body).body["choices"][0]
        content = choice["message"]["content"]
        assert content.startswith("{"), content
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(content), dict), content
            finished += 1
    assert finished >= 2, "too few answers finished to show anything"


def refusal(body, endpoint=CHAT):
    with pytest.raises(ApiError) as caught:
        parse_request(endpoint, body, strict=True, param_prefix="body.")
    return caught.value


BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PATH = "body.response_format.json_schema.schema"


@pytest.mark.parametrize("schema,strict,param,words", [
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}, "required": ["a"],
      "additionalProperties": False}, True, f"{PATH}.properties.a.oneOf", "outside the JSON Schema subset"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, True,
     f"{PATH}.additionalProperties", "additionalProperties: false"),
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"],
      "additionalProperties": False}, True, f"{PATH}.required", "'b'"),
    ({"type": "array", "items": {"type": "string"}}, True, f"{PATH}.type", "root must be an object"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"],
      "additionalProperties": False}, True, f"{PATH}.properties.a.$ref", "does not name a definition"),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, False, f"{PATH}.properties.a.type", "unknown type"),
    ({"type": "object", "allOf": []}, False, f"{PATH}.allOf", "allOf"),
])
def test_a_schema_outside_the_subset_is_400_naming_its_path(schema, strict, param, words):
    error = refusal({**BASE, "response_format": schema_format(schema, strict)})
    assert (error.status, error.code, error.param) == (400, "invalid_request_error", param)
    assert words in error.message


def test_nesting_past_ten_levels_and_a_bad_type_are_refused():
    deep = {"type": "string"}
    for _ in range(12):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"], "additionalProperties": False}
    assert "nested more than 10" in refusal({**BASE, "response_format": schema_format(deep)}).message
    error = refusal({**BASE, "response_format": {"type": "xml"}})
    assert error.param == "body.response_format.type"


def test_scoring_mode_refuses_a_grammar():
    error = refusal({**BASE, "logprobs": True, "max_tokens": 1, "response_format": {"type": "json_object"}})
    assert (error.code, error.param) == ("field_not_honoured", "body.response_format")
    parse_request(CHAT, {**BASE, "logprobs": True, "max_tokens": 1, "response_format": {"type": "text"}}, strict=True)


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_grammar_cannot_build_is_400_before_any_forward_pass_or_byte(resident, stream):
    # The subset check passes a `pattern` (it is a string); llguidance's regex parser does not. The
    # engine compiles in check_controls, so a stream is refused before its headers go out.
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}},
              "required": ["a"], "additionalProperties": False}
    parsed = parse_request(CHAT, chat_body(resident, 0, schema_format(schema), stream=stream), strict=True)
    with pytest.raises(ApiError) as caught:
        (services.stream if stream else services.run)(resident, parsed)
    assert (caught.value.status, caught.value.param) == (400, "response_format")
    assert "unclosed group" in caught.value.message
