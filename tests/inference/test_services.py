"""The service functions on the tiny model, loaded through the production loader."""

import base64
import math

import numpy as np
import pytest
import torch

from inference_app.engine import services
from millm_lib.errors import ApiError
from inference_app.schemas import parse_request

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def run(resident, endpoint, **body):
    model = {"model": resident.model_id}
    return services.run(resident, parse_request(endpoint, {**model, **body}, strict=True))


def chat(resident, content="Hello there", **fields):
    return run(resident, CHAT, messages=[{"role": "user", "content": content}], **fields)


def test_greedy_chat_is_deterministic_and_counts_tokens(resident):
    first = chat(resident, max_tokens=6, temperature=0).body
    second = chat(resident, max_tokens=6, temperature=0).body
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    usage = first["usage"]
    prompt = resident.encode(resident.render_chat(parse_request(CHAT, {"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}, True).request.messages))
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == 6 and first["choices"][0]["finish_reason"] == "length"


def test_a_stop_sequence_cuts_the_text_before_it(resident):
    whole = chat(resident, max_tokens=12, temperature=0).body["choices"][0]["message"]["content"]
    stop = whole[3:6]
    cut = chat(resident, max_tokens=12, temperature=0, stop=stop).body["choices"][0]
    assert cut["message"]["content"] == whole[: whole.index(stop)]
    assert cut["finish_reason"] == "stop"


def test_the_stream_holds_back_a_possible_stop_and_matches_the_whole(resident):
    whole = chat(resident, max_tokens=12, temperature=0).body["choices"][0]["message"]["content"]
    stop = whole[5:9]
    parsed = parse_request(CHAT, {"model": resident.model_id, "messages": [{"role": "user", "content": "Hello there"}],
                                  "max_tokens": 12, "temperature": 0, "stop": [stop], "stream": True}, True)
    headers, chunks = services.stream(resident, parsed)
    chunks = list(chunks)
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert text == whole[: whole.index(stop)]
    assert stop not in text
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert headers["X-miLLM-Model"] == resident.model_id


def test_generation_stops_when_cancelled(resident):
    calls = []

    def cancelled():
        calls.append(1)
        return len(calls) > 3

    body = services.run(resident, parse_request(CHAT, {"model": resident.model_id, "messages": [{"role": "user", "content": "x"}], "max_tokens": 50, "temperature": 0}, True), cancelled).body
    assert body["usage"]["completion_tokens"] == 3


def test_chat_default_max_tokens_never_asks_past_the_context(resident):
    long = "word " * 900
    body = chat(resident, content=long, temperature=0).body
    assert body["usage"]["total_tokens"] <= resident.context_length


def test_over_long_prompt_is_refused_naming_both_numbers(resident):
    with pytest.raises(ApiError) as caught:
        run(resident, COMPLETIONS, prompt="word " * 1100, max_tokens=4)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "prompt"
    assert str(resident.context_length) in caught.value.message


def test_chat_scoring_equals_completions_scoring_of_the_rendered_prompt_to_the_bit(resident):
    messages = [{"role": "system", "content": "Label it."}, {"role": "user", "content": "Great movie!"}]
    scored = run(resident, CHAT, messages=messages, logprobs=True, top_logprobs=5, max_tokens=1).body
    rendered = resident.render_chat(parse_request(CHAT, {"model": "m", "messages": messages}, True).request.messages)
    legacy = run(resident, COMPLETIONS, prompt=rendered, logprobs=5, max_tokens=1).body
    entry = scored["choices"][0]["logprobs"]["content"][0]
    choice = legacy["choices"][0]
    assert entry["token"] == choice["logprobs"]["tokens"][0] == choice["text"]
    assert entry["logprob"] == choice["logprobs"]["token_logprobs"][0]
    assert [(item["token"], item["logprob"]) for item in entry["top_logprobs"]] == list(choice["logprobs"]["top_logprobs"][0].items())
    assert scored["usage"] == legacy["usage"]


def test_scoring_computes_the_distribution_at_the_last_prompt_token(resident):
    prompt = "The weather today is"
    body = run(resident, COMPLETIONS, prompt=prompt, logprobs=3, max_tokens=1).body
    ids = torch.tensor([resident.encode(prompt)])
    with torch.inference_mode():
        reference = torch.log_softmax(resident.model(input_ids=ids).logits[0, -1].float(), dim=-1)
    best = int(torch.argmax(reference))
    assert body["choices"][0]["logprobs"]["token_logprobs"][0] == pytest.approx(float(reference[best]), abs=1e-5)
    assert body["choices"][0]["text"] == resident.token_string(best)


def test_allowed_token_ids_renormalise_over_the_allowed_set(resident):
    allowed = [resident.encode(" yes")[0], resident.encode(" no")[0]]
    body = chat(resident, allowed_token_ids=allowed, max_tokens=1, logprobs=True, top_logprobs=5).body
    entry = body["choices"][0]["logprobs"]["content"][0]
    tokens = {item["token"] for item in entry["top_logprobs"]}
    assert tokens == {" yes", " no"}
    assert math.isclose(sum(math.exp(item["logprob"]) for item in entry["top_logprobs"]), 1.0, abs_tol=1e-5)


def test_a_token_id_outside_the_vocabulary_is_invalid_scoring_request(resident):
    with pytest.raises(ApiError) as caught:
        chat(resident, allowed_token_ids=[resident.vocab_size + 5], max_tokens=1)
    assert caught.value.code == "invalid_scoring_request"


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_embeddings_pool_the_last_hidden_layer(resident, pooling):
    body = run(resident, "/v1/embeddings", input="pool me please", pooling=pooling).body
    ids = torch.tensor([resident.encode("pool me please")])
    with torch.inference_mode():
        hidden = resident.model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
    expected = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[pooling]
    assert body["data"][0]["embedding"] == pytest.approx(expected.tolist(), abs=1e-5)


def test_normalized_base64_embeddings_are_unit_float32(resident):
    body = run(resident, "/v1/embeddings", input=["a", "bb"], normalize=True, encoding_format="base64").body
    vector = np.frombuffer(base64.b64decode(body["data"][1]["embedding"]), dtype="<f4")
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-6)


def test_an_over_long_embedding_input_fails_before_any_forward_pass(resident):
    with pytest.raises(ApiError) as caught:
        run(resident, "/v1/embeddings", input=["fine", "word " * 1100])
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "input[1]"


def test_a_model_the_engine_does_not_hold_is_refused(resident):
    with pytest.raises(ApiError) as caught:
        services.run(resident, parse_request(CHAT, {"model": "other", "messages": [{"role": "user", "content": "x"}]}, True))
    assert caught.value.code == "model_not_found"


def test_generated_logprobs_keep_each_tokens_offset_and_a_stop_drops_the_tokens_it_cut(resident):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    whole = run(resident, COMPLETIONS, **body).body["choices"][0]
    text, offsets = whole["text"], whole["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == 12
    cut = len(text) // 2
    stop = text[cut:cut + 2]
    cut = text.index(stop)
    stopped = run(resident, COMPLETIONS, stop=[stop], **body).body["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == text[:cut]
    # The tokens whose text begins before the cut keep their entries, the same as without the stop.
    kept = [offset for offset in offsets if offset < cut]
    assert stopped["logprobs"]["text_offset"] == kept
    assert stopped["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"][:len(kept)]
