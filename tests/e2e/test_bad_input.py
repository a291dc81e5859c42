"""Bad input gets a clear 4xx in the documented envelope, never a 500."""

import json

import httpx
import pytest

from tests.e2e.batch_helpers import line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return json.dumps({"model": MODEL_ID, "messages": USER, "max_tokens": 2, **fields})


CASES = [
    # (name, path, raw body, status, code, param)
    ("malformed json", CHAT, '{"model": ', 400, "invalid_json", None),
    ("not an object", CHAT, "[1, 2]", 400, "invalid_parameter", None),
    ("invalid utf-8", CHAT, b'{"model": "\xff"}', 400, "invalid_json", None),
    ("NaN literal", CHAT, chat().replace('"max_tokens": 2', '"temperature": NaN'), 400, "invalid_json", None),
    ("deep nesting", CHAT, "[" * 100_000 + "]" * 100_000, 400, "invalid_json", None),
    ("missing model", CHAT, json.dumps({"messages": USER}), 400, "invalid_parameter", "model"),
    ("model a number", CHAT, chat(model=5), 400, "invalid_parameter", "model"),
    ("empty messages", CHAT, chat(messages=[]), 400, "invalid_parameter", "messages"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "invalid_parameter", "messages.0.role"),
    ("content a number", CHAT, chat(messages=[{"role": "user", "content": 7}]), 400, "invalid_parameter", "messages.0.content"),
    ("bad content part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image"}]}]), 400, "invalid_parameter", "messages.0.content.0.type"),
    ("max_tokens a string", CHAT, chat(max_tokens="5"), 400, "invalid_parameter", "max_tokens"),
    ("max_tokens zero", CHAT, chat(max_tokens=0), 400, "invalid_parameter", "max_tokens"),
    ("huge max_tokens", CHAT, chat(max_tokens=10**30), 400, "context_length_exceeded", "messages"),
    ("both token limits differ", CHAT, chat(max_completion_tokens=3), 400, "invalid_parameter", "max_completion_tokens"),
    ("negative seed", CHAT, chat(seed=-1), 400, "invalid_parameter", "seed"),
    ("seed over 2^32-1", CHAT, chat(seed=2**32), 400, "invalid_parameter", "seed"),
    ("boolean seed", CHAT, chat(seed=True), 400, "invalid_parameter", "seed"),
    ("temperature over 2", CHAT, chat(temperature=2.5), 400, "invalid_parameter", "temperature"),
    ("huge temperature", CHAT, chat().replace('"max_tokens": 2', '"temperature": 1e999'), 400, "invalid_parameter", "temperature"),
    ("n of 9", CHAT, chat(n=9), 400, "invalid_parameter", "n"),
    ("five stops", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "invalid_parameter", "stop"),
    ("a tool without its function", CHAT, chat(tools=[{"type": "function"}]), 400, "invalid_parameter", "tools.0.function"),
    ("a named tool not among the tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                    tool_choice={"type": "function", "function": {"name": "g"}}),
     400, "invalid_request_error", "tool_choice.function.name"),
    ("a schema outside the subset", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "oneOf": []}}}), 400, "invalid_request_error",
     "response_format.json_schema.schema.oneOf"),
    ("a strict schema leaving a property out", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                               "additionalProperties": False}}}),
     400, "invalid_request_error", "response_format.json_schema.schema.required"),
    ("scoring without max_tokens 1", CHAT, chat(allowed_token_ids=[5], max_tokens=3), 400, "invalid_parameter", "max_tokens"),
    ("logprobs on generated tokens over 5", "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "x", "max_tokens": 3,
                                                                     "logprobs": 6}), 400, "invalid_parameter", "logprobs"),
    ("top_logprobs over 20", CHAT, chat(logprobs=True, max_tokens=1, top_logprobs=21), 400, "invalid_parameter", "top_logprobs"),
    ("empty embedding input", "/v1/embeddings", json.dumps({"model": MODEL_ID, "input": ""}), 400, "invalid_parameter", "input"),
    ("unknown pooling", "/v1/embeddings", json.dumps({"model": MODEL_ID, "input": "x", "pooling": "max"}), 400, "invalid_parameter", "pooling"),
    ("prompt a dict", "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": {"a": 1}}), 400, "invalid_parameter", "prompt"),
    ("echo", "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "x", "echo": True}), 400, "field_not_honoured", "echo"),
    ("model prefix without tag", CHAT, chat(model="tiny"), 404, "model_not_found", "model"),
]


@pytest.mark.parametrize("name,path,body,status,code,param", CASES, ids=[case[0] for case in CASES])
def test_bad_bodies_get_a_clear_4xx_in_the_envelope(stack, name, path, body, status, code, param):
    response = httpx.post(stack.web.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["X-Request-ID"]


def test_a_validation_message_names_the_field_and_counts_the_rest(stack):
    # Three errors: the role, the seed, the temperature (content may be absent on an assistant's tool call).
    body = json.dumps({"model": MODEL_ID, "messages": [{"role": "wizard"}], "seed": -1, "temperature": 9})
    error = httpx.post(stack.web.url + CHAT, content=body, headers={"Content-Type": "application/json"}).json()["error"]
    assert error["message"].startswith(f"Invalid value for '{error['param']}': ")
    assert error["message"].endswith("(and 2 more validation errors)")


def test_a_bad_strict_header_is_invalid_parameter_naming_the_header(stack):
    response = httpx.post(
        stack.web.url + CHAT, content=chat(), headers={"Content-Type": "application/json", "X-miLLM-Strict": "maybe"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "X-miLLM-Strict"


def test_an_unknown_v1_route_is_404_in_the_envelope(stack):
    response = httpx.get(stack.web.url + "/v1/nothing/here")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert "/v1/nothing/here" in response.json()["error"]["message"]


def test_a_wrong_method_is_405_in_the_envelope(stack):
    response = httpx.get(stack.web.url + CHAT)
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert response.headers["Allow"] == "POST"


def test_a_body_that_is_not_json_is_415(stack):
    response = httpx.post(stack.web.url + CHAT, data={"model": MODEL_ID})
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_the_request_id_sent_is_echoed(stack):
    response = httpx.post(
        stack.web.url + CHAT, content="{", headers={"Content-Type": "application/json", "X-Request-ID": "trace-42"}
    )
    assert response.headers["X-Request-ID"] == "trace-42"


@pytest.fixture(scope="module")
def small_body_web(stack):
    web = stack.start_web(MILLM_MAX_BODY_BYTES=4096)
    yield web
    web.stop()


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(small_body_web):
    body = chat(messages=[{"role": "user", "content": "x" * 10_000}])
    response = httpx.post(small_body_web.url + CHAT, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert "4096" in error["message"] and "MILLM_MAX_BODY_BYTES" in error["message"]
    assert f"{len(body):,} bytes declared" in error["message"]


def test_a_chunked_body_over_the_limit_is_413(small_body_web):
    def pieces():
        yield b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    response = httpx.post(small_body_web.url + CHAT, content=pieces(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def test_an_invalid_batch_line_carries_the_synchronous_code_and_message_as_the_readme_says(stack, client):
    """README ("How it runs", Validation): an invalid line's error has the synchronous route's
    code, and its message as `Line N: <message>`, the field it names written as the line's path
    (`body.temperature` where the route says `temperature`); `errors[].param` is that path."""
    bad = [
        {"model": MODEL_ID, "messages": [], "max_tokens": 2},
        {"model": MODEL_ID, "messages": [{"role": "wizard", "content": "x"}], "max_tokens": 2},
        {"model": MODEL_ID, "messages": USER, "max_tokens": 2, "temperature": 9},
        {"model": MODEL_ID, "messages": USER, "max_tokens": 0},
        {"model": "no-such-model", "messages": USER, "max_tokens": 2},
    ]
    synchronous = []
    for body in bad:
        answer = httpx.post(stack.web.url + CHAT, json=body, headers={"X-miLLM-Load-Policy": "refuse"}, timeout=30)
        assert 400 <= answer.status_code < 500, answer.text
        synchronous.append(answer.json()["error"])
    lines = [line(f"bad-{index}", CHAT, body) for index, body in enumerate(bad)]
    lines.append(line("good", CHAT, {"model": MODEL_ID, "messages": USER, "max_tokens": 2}))
    done = wait_for(client, start_batch(client, lines, CHAT).id, timeout=120)
    errors = {row["custom_id"]: row for row in read_jsonl(client, done.error_file_id)}
    listed = {error.line: error for error in done.errors.data}
    for number, expected in enumerate(synchronous, start=1):
        row = errors[f"bad-{number - 1}"]
        path = f"body.{expected['param']}"
        message = expected["message"].replace(f"'{expected['param']}'", f"'{path}'")
        assert row["line"] == number and row["response"] is None
        assert row["error"] == {"code": expected["code"], "message": f"Line {number}: {message}"}
        assert (listed[number].code, listed[number].message, listed[number].param) == (expected["code"], row["error"]["message"], path)
