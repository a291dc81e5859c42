"""Shared prefixes computed once (issue 45), on the tiny model in float32: a reused prefix gives
the answers a whole run gives (to 1e-4), the cache is found by the longest held block prefix,
stays within its bound, and a weight edit empties it."""

import pytest
import torch

from inference_app.engine import packing, prefix_cache, services, weights
from inference_app.engine.decoding import BatchedDecoder
from inference_app.engine.prefix_cache import BLOCK_TOKENS, PrefixCache, common_prefix_length, reusable_length
from inference_app.schemas import parse_request

INSTRUCTION = ("You are an annotator. Read the text and answer with one label among positive, negative and "
               "neutral. Think of the tone, the words and the context of each sentence before you answer. ") * 2


@pytest.fixture
def cache(resident):
    resident.prefix_cache.clear()
    yield resident.prefix_cache
    resident.prefix_cache.clear()


def scoring_row(resident, text):
    body = {"model": resident.model_id, "prompt": INSTRUCTION + "Text: " + text + "\nLabel:", "max_tokens": 1,
            "logprobs": 5}
    return parse_request("/v1/completions", body, strict=True)


TEXTS = ["I loved it.", "Terrible service, never again, and the food was cold too.", "It was fine.", "Meh"]


def test_block_arithmetic():
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length([[5], [6]]) == 0
    shared = list(range(2 * BLOCK_TOKENS + BLOCK_TOKENS // 2))  # two blocks and a half
    # Each sequence keeps its own last token: a row no longer than the shared part still runs one.
    assert reusable_length([shared + [1], shared + [2]]) == 2 * BLOCK_TOKENS
    assert reusable_length([shared[:2 * BLOCK_TOKENS + 1], shared]) == 2 * BLOCK_TOKENS
    assert reusable_length([shared[:2 * BLOCK_TOKENS], shared]) == BLOCK_TOKENS
    assert reusable_length([shared[:BLOCK_TOKENS - 1], shared]) == 0


def test_reused_scoring_rows_match_whole_rows_in_float32(resident, cache, settings):
    settings.BATCH_PACK_MAX_ROWS = 16
    rows = [scoring_row(resident, text) for text in TEXTS]
    whole = packing.run_packed(resident, rows)
    reused = packing.run_packed(resident, rows, reuse=True)
    shared = reusable_length([services.plan(resident, row)[0] for row in rows])
    assert shared >= 2 * BLOCK_TOKENS
    for row, plain, again in zip(rows, whole, reused):
        single = services.run(resident, row).body["choices"][0]["logprobs"]
        logprobs = again.body["choices"][0]["logprobs"]
        assert logprobs["tokens"] == single["tokens"]
        for token, value in single["top_logprobs"][0].items():
            assert logprobs["top_logprobs"][0][token] == pytest.approx(value, abs=1e-4)
        assert again.body["usage"]["prompt_tokens_details"] == {"cached_tokens": shared}
        assert "prompt_tokens_details" not in plain.body["usage"]
    assert len(cache) == 1 and cache.nbytes > 0


def test_a_later_pack_reuses_and_extends_the_held_prefix(resident, cache):
    first = [services.plan(resident, scoring_row(resident, text))[0] for text in TEXTS[:2]]
    length = reusable_length(first)
    held = prefix_cache.prefix_for(resident, first[0][:length])
    assert prefix_cache.prefix_for(resident, first[0][:length]) is held  # found, not computed again
    longer = first[0][:length] + [7] * BLOCK_TOKENS
    extended = prefix_cache.prefix_for(resident, longer)
    assert len(extended.tokens) == length + BLOCK_TOKENS and len(cache) == 2
    # The extension, computed from the held prefix, equals a whole run of its tokens.
    ids = torch.tensor([longer + [9]])
    alone = resident.model(input_ids=ids, use_cache=False).logits[0, -1].float()
    assert torch.allclose(resident.packed_last_logits([longer + [9]], extended)[0], alone, atol=1e-4)


def test_the_cache_stays_within_its_bound_and_drops_the_least_recently_used(resident, cache):
    one = prefix_cache.prefix_for(resident, list(range(10, 10 + BLOCK_TOKENS)))
    bounded = PrefixCache(int(one.nbytes * 2.5))
    prompts = [[start] * BLOCK_TOKENS for start in range(1, 6)]
    for prompt in prompts:
        bounded.put(prompt, one.layers)
        assert bounded.nbytes <= bounded.limit_bytes
    assert len(bounded) == 2
    assert bounded.longest(prompts[0]) is None and bounded.longest(prompts[-1]) is not None
    assert PrefixCache(one.nbytes - 1).put(prompts[0], one.layers) is not None  # over the bound alone: not held


def test_a_weight_edit_empties_the_cache_and_the_old_prefix_is_never_read(resident, cache):
    prompt = services.plan(resident, scoring_row(resident, TEXTS[0]))[0]
    length = reusable_length([prompt, prompt[:-1] + [0]])
    prefix_cache.prefix_for(resident, prompt[:length])
    assert cache.longest(prompt) is not None
    name = "model.norm.weight"
    before = dict(resident.model.named_parameters())[name].detach().clone()
    try:
        weights.write(resident.model, {name: before * 2})
        resident.weights_changed()
        assert len(cache) == 0 and cache.longest(prompt) is None
        fresh = packing.run_packed(resident, [scoring_row(resident, TEXTS[0])], reuse=True)[0]
        plain = services.run(resident, scoring_row(resident, TEXTS[0])).body
        got, want = fresh.body["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
        assert got["token_logprobs"][0] == pytest.approx(want["token_logprobs"][0], abs=1e-4)
    finally:
        weights.write(resident.model, {name: before})
        resident.weights_changed()


def test_a_prefill_begins_from_the_longest_held_prefix_and_leaves_its_own(resident, cache):
    decoder = BatchedDecoder(resident)
    system = resident.encode(INSTRUCTION)
    first = system + resident.encode(" A first question, long enough to hold whole blocks of its own beyond the "
                                     "system prompt: what is the tone of this text, and why do you say so?")
    _, logits_alone = decoder.prefill(first)
    _, logits, reused = decoder.prefill_reusing(first)
    assert reused == 0 and torch.allclose(logits, logits_alone, atol=1e-4)
    assert len(cache.longest(first).tokens) > len(system)  # it held blocks past the system prompt
    second = system + resident.encode(" Another, longer question about something else?")
    _, logits_alone = decoder.prefill(second)
    _, logits, reused = decoder.prefill_reusing(second)
    # It parts from the held prefix inside it: the whole blocks before the parting are reused.
    assert reused == reusable_length([first, second]) and reused >= 2 * BLOCK_TOKENS
    assert torch.allclose(logits, logits_alone, atol=1e-4)
    assert int(logits.argmax()) == int(logits_alone.argmax())


def test_fifty_thousand_rows_keep_the_cache_and_its_index_within_the_bound(resident, cache):
    """A 50,000-row batch whose every row leaves a prefix of its own (a seated row's prefill does):
    the held bytes never pass the bound, and the block index holds only what is held."""
    layers = prefix_cache.prefix_for(resident, list(range(3, 3 + 2 * BLOCK_TOKENS))).layers
    bounded = PrefixCache(int(layers[0][0].nbytes * 2 * len(layers) * 10.5))  # room for ten entries
    shared = list(range(100, 100 + BLOCK_TOKENS))
    for row in range(50_000):
        bounded.put(shared + [row % 30_000, row // 30_000] * (BLOCK_TOKENS // 2), layers, owner="batch_a")
        assert bounded.nbytes <= bounded.limit_bytes
    assert len(bounded) == 10
    assert len(bounded._boundaries) == 1 + len(bounded)  # the shared first block, and each prefix's second
    assert sum(len(holders) for holders in bounded._boundaries.values()) == 2 * len(bounded)
    assert bounded.longest(shared + [1]) is not None  # the shared first block is still found
    assert bounded.drop("batch_b") == 0 and bounded.drop("batch_a") == 10
    assert len(bounded) == 0 and bounded.nbytes == 0 and not bounded._boundaries


def test_a_prefix_stays_found_when_a_longer_one_through_its_blocks_is_dropped(resident, cache):
    short = list(range(1, 1 + BLOCK_TOKENS))
    prefix_cache.prefix_for(resident, short, owner="batch_1")
    prefix_cache.prefix_for(resident, short + list(range(200, 200 + BLOCK_TOKENS)), owner="batch_2")
    assert cache.drop("batch_2") == 1
    assert len(cache.longest(short + [9]).tokens) == BLOCK_TOKENS


def test_a_boundary_key_that_collides_is_caught_by_its_tokens():
    """A hash is not proof: a boundary key pointing at an entry whose tokens differ there serves
    only the blocks before it, and a colliding first block serves nothing."""
    layer = torch.zeros(1, 1, 2 * BLOCK_TOKENS, 1)
    cache = PrefixCache(1 << 20)
    held = cache.put(list(range(2 * BLOCK_TOKENS)), [(layer, layer)])
    same_first = list(range(BLOCK_TOKENS)) + [99] * BLOCK_TOKENS + [1]
    other_first = [99] * (2 * BLOCK_TOKENS) + [1]
    for prompt in (same_first, other_first):  # the held entry answers at every one of their boundaries
        for _, key in cache._chain(prompt, 2 * BLOCK_TOKENS):
            cache._boundaries.setdefault(key, []).append(held)
    assert len(cache.longest(same_first).tokens) == BLOCK_TOKENS
    assert cache.longest(other_first) is None
    assert cache.longest(list(range(2 * BLOCK_TOKENS)) + [1]) is held


def test_a_batchs_prefixes_leave_when_it_ends_and_others_stay(resident, cache):
    mine, theirs = list(range(1, 1 + BLOCK_TOKENS)), list(range(50, 50 + BLOCK_TOKENS))
    prefix_cache.prefix_for(resident, mine, owner="batch_1")
    prefix_cache.prefix_for(resident, theirs)
    assert cache.drop("batch_1") == 1
    assert cache.longest(mine) is None and cache.longest(theirs) is not None


@pytest.mark.slow
def test_a_50000_row_scoring_batch_keeps_the_cache_within_its_bound(resident, settings):
    """The runner's path for 50,000 packed rows with prefix reuse: chunks of 16 rows, each chunk
    on an instruction of its own (so every chunk leaves a new prefix), a 256 KB bound."""
    settings.BATCH_PACK_MAX_ROWS = 16
    bounded = PrefixCache(256 * 1024)
    held, resident.prefix_cache = resident.prefix_cache, bounded
    try:
        peak = 0
        for chunk in range(50_000 // 16):
            instruction = f"Instruction {chunk}: " + "label the text " * 8
            rows = [parse_request("/v1/completions", {"model": resident.model_id, "prompt": f"{instruction}{row}",
                                                      "max_tokens": 1, "logprobs": 1}, True) for row in range(16)]
            outcomes = packing.run_packed(resident, rows, reuse=f"batch_{chunk % 7}")
            assert outcomes[0].body["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK_TOKENS
            peak = max(peak, bounded.nbytes)
            assert bounded.nbytes <= bounded.limit_bytes
        assert peak > bounded.limit_bytes / 2  # the bound was reached, and held
    finally:
        resident.prefix_cache = held
