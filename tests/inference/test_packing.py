"""Packed scoring and embeddings on the tiny model (float32): each sequence is read at its own
last real token and agrees with the single path to 1e-5."""

import pytest
import torch

from inference_app.engine import packing, services
from millm_lib.errors import ApiError
from inference_app.schemas import parse_request

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog and keeps running far away", "A b c",
           "Some medium length prompt here", "x " * 40]


def completion(resident, prompt, **fields):
    body = {"model": resident.model_id, "prompt": prompt, "max_tokens": 1, "logprobs": 5, **fields}
    return parse_request("/v1/completions", body, strict=True)


def test_packed_scoring_of_mixed_lengths_matches_single_rows(resident, settings):
    settings.BATCH_PACK_MAX_ROWS = 16
    rows = [completion(resident, prompt) for prompt in PROMPTS]
    packed = packing.run_packed(resident, rows)
    for row, outcome in zip(rows, packed):
        single = services.run(resident, row).body["choices"][0]["logprobs"]
        together = outcome.body["choices"][0]["logprobs"]
        assert together["tokens"] == single["tokens"]
        assert together["token_logprobs"][0] == pytest.approx(single["token_logprobs"][0], abs=1e-5)
        for token, value in single["top_logprobs"][0].items():
            assert together["top_logprobs"][0][token] == pytest.approx(value, abs=1e-5)


def test_padding_never_sits_between_a_prompt_and_its_scored_position(resident):
    short, long = resident.encode("Hi"), resident.encode("x " * 40)
    packed = resident.packed_last_logits([short, long])
    # Reading the short prompt at the pack's last column (a padding position) would differ.
    assert torch.allclose(packed[0], resident.last_logits(short), atol=1e-5)
    assert torch.allclose(packed[1], resident.last_logits(long), atol=1e-5)
    assert not torch.allclose(packed[0], resident.last_logits(short + [resident.tokenizer.pad_token_id] * 5), atol=1e-3)


def test_chat_scoring_rows_pack_with_their_own_temperatures_and_allowed_ids(resident):
    yes, no = resident.encode(" yes")[0], resident.encode(" no")[0]
    rows = [
        parse_request("/v1/chat/completions", {"model": resident.model_id, "messages": [{"role": "user", "content": text}],
                                               "max_tokens": 1, "logprobs": True, "top_logprobs": 2, **extra}, True)
        for text, extra in [("Is it?", {"allowed_token_ids": [yes, no]}), ("A longer question to pack with", {"temperature": 0.7})]
    ]
    for row, outcome in zip(rows, packing.run_packed(resident, rows)):
        single = services.run(resident, row).body["choices"][0]["logprobs"]["content"][0]
        together = outcome.body["choices"][0]["logprobs"]["content"][0]
        assert together["token"] == single["token"]
        assert [item["token"] for item in together["top_logprobs"]] == [item["token"] for item in single["top_logprobs"]]
        assert together["logprob"] == pytest.approx(single["logprob"], abs=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_packed_embeddings_pool_each_input_over_its_own_tokens(resident, pooling):
    rows = [parse_request("/v1/embeddings", {"model": resident.model_id, "input": PROMPTS[:3], "pooling": pooling}, True),
            parse_request("/v1/embeddings", {"model": resident.model_id, "input": PROMPTS[3:], "pooling": pooling,
                                             "normalize": True}, True)]
    for row, outcome in zip(rows, packing.run_packed(resident, rows)):
        single = services.run(resident, row).body["data"]
        for alone, together in zip(single, outcome.body["data"]):
            assert together["embedding"] == pytest.approx(alone["embedding"], abs=1e-5)


def test_a_row_the_endpoint_would_refuse_fails_alone_and_the_pack_still_runs(resident):
    rows = [completion(resident, "fine"), completion(resident, "word " * 1100), completion(resident, "also fine")]
    outcomes = packing.run_packed(resident, rows)
    assert isinstance(outcomes[1], ApiError) and outcomes[1].code == "context_length_exceeded"
    assert outcomes[0].body["choices"][0]["text"] and outcomes[2].body["choices"][0]["text"]


def test_packs_respect_the_row_and_padded_token_budgets():
    sequences = [(index, 0, [1] * length) for index, length in enumerate([10, 10, 10, 50, 10, 200])]
    groups = [[item[0] for item in group] for group in packing.packs(sequences, max_rows=3, max_tokens=120)]
    # Three rows at most; 3 x 50 padded tokens would pass 120; a 200-token row runs alone.
    assert groups == [[0, 1, 2], [3, 4], [5]]
