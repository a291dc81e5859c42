import pytest

from millm_lib.errors import ApiError
from millm_lib.jsonbody import decode_json
from inference_app.schemas import parse_request, parse_strict_header

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refusal(endpoint, body, strict=False):
    with pytest.raises(ApiError) as caught:
        parse_request(endpoint, body, strict)
    return caught.value


def test_unused_fields_are_listed_in_request_order_with_nested_paths():
    body = {"zeta": 1, **BASE, "messages": [{"role": "user", "content": "hi", "name": "n"}], "user": "u"}
    assert parse_request(CHAT, body, strict=False).ignored == ["zeta", "messages[0].name", "user"]


def test_strict_mode_refuses_every_unused_field_with_the_first_as_param():
    error = refusal(CHAT, {**BASE, "user": "u", "extra": {"a": 1}}, strict=True)
    assert error.code == "unused_fields_refused"
    assert error.param == "user"
    assert "user, extra" in error.message


def test_a_prefix_names_batch_line_params():
    with pytest.raises(ApiError) as caught:
        parse_request(CHAT, {**BASE, "seed": -3}, strict=True, param_prefix="body.")
    assert caught.value.param == "body.seed"
    assert caught.value.message.startswith("Invalid value for 'body.seed': ")


def test_json_null_means_not_sent():
    parsed = parse_request(CHAT, {**BASE, "seed": None, "user": None, "tools": None}, strict=True)
    assert parsed.request.seed is None
    assert parsed.ignored == []


def test_neutral_values_of_unhonoured_fields_pass():
    neutral = {**BASE, "tools": [], "tool_choice": "none", "logit_bias": {}, "response_format": {"type": "text"},
               "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1}
    assert parse_request(CHAT, neutral, strict=True).ignored == []


@pytest.mark.parametrize("field,value", [("echo", True), ("best_of", 2), ("suffix", "end")])
def test_non_neutral_values_are_field_not_honoured(field, value):
    error = refusal(COMPLETIONS, {"model": "m", "prompt": "x", field: value})
    assert (error.code, error.param) == ("field_not_honoured", field)


def test_n_is_honoured_up_to_eight_and_not_in_scoring_mode():
    assert parse_request(CHAT, {**BASE, "n": 8}, strict=True).request.n == 8
    error = refusal(CHAT, {**BASE, "n": 9})
    assert (error.code, error.param) == ("invalid_parameter", "n") and "8" in error.message
    error = refusal(CHAT, {**BASE, "n": 2, "logprobs": True, "max_tokens": 1})
    assert (error.code, error.param) == ("invalid_parameter", "n") and "one choice" in error.message


def test_scoring_mode_needs_an_explicit_max_tokens_of_one():
    error = refusal(CHAT, {**BASE, "allowed_token_ids": [1]})
    assert error.param == "max_completion_tokens" and "got nothing" in error.message
    assert parse_request(CHAT, {**BASE, "logprobs": True, "max_completion_tokens": 1}, strict=True).request.is_scoring()


def test_logprobs_with_any_other_max_tokens_generate_with_logprobs_on_each_token():
    for extra in ({}, {"max_tokens": 16}, {"max_completion_tokens": 2}):
        request = parse_request(CHAT, {**BASE, "logprobs": True, "top_logprobs": 3, **extra}, strict=True).request
        assert not request.is_scoring() and request.generated_logprobs() == 3
    assert parse_request(CHAT, {**BASE, "logprobs": True, "max_tokens": 1}, strict=True).request.generated_logprobs() is None
    completion = parse_request("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 4, "logprobs": 0}, True)
    assert not completion.request.is_scoring() and completion.request.generated_logprobs() == 0
    error = refusal("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 4, "logprobs": 6})
    assert error.param == "logprobs" and "from 0 to 5" in error.message and "got 6" in error.message


def test_scoring_mode_refuses_streams_and_tiny_temperatures():
    assert refusal(CHAT, {**BASE, "logprobs": True, "max_tokens": 1, "stream": True}).param == "stream"
    assert refusal(CHAT, {**BASE, "allowed_token_ids": [1], "max_tokens": 1, "temperature": 0.0005}).param == "temperature"


def test_a_streamed_completion_takes_one_prompt():
    error = refusal("/v1/completions", {"model": "m", "prompt": ["a", "b"], "stream": True})
    assert error.param == "prompt"


def test_embeddings_inputs_are_limited_by_the_setting(settings):
    settings.EMBEDDINGS_MAX_INPUTS = 2
    error = refusal("/v1/embeddings", {"model": "m", "input": ["a", "b", "c"]})
    assert error.param == "input" and "EMBEDDINGS_MAX_INPUTS" in error.message and "3 inputs" in error.message


@pytest.mark.parametrize("value,expected", [("TRUE", True), ("1", True), ("False", False), ("0", False)])
def test_the_strict_header_takes_four_spellings(value, expected):
    assert parse_strict_header(value) is expected


def test_the_strict_header_defaults_to_the_setting(settings):
    settings.MILLM_STRICT_DEFAULT = True
    assert parse_strict_header(None) is True


def test_decode_json_refuses_nan_and_bad_utf8():
    with pytest.raises(ApiError, match="NaN"):
        decode_json(b'{"a": NaN}')
    with pytest.raises(ApiError, match="UTF-8"):
        decode_json(b'{"a": "\xfe"}')
