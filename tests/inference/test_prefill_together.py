"""Prompts that join at one step boundary prefilled in one padded pass (ENGINE_PREFILL_TOGETHER):
each row's logits are its prompt's alone, at the prefill and at every decode step after it, for
the tiny Llama and every other tiny architecture (the sliding-window ones with a window shorter
than the prompts, so the padded pass's window is exercised); the scheduler runs the joiners'
prefills as one pass where the policy says so, and their tokens are the tokens they make alone."""

import threading
import time

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from inference_app.engine import policy
from inference_app.engine.decoding import BatchedDecoder, GrowingLayer
from inference_app.engine.scheduler import StepScheduler
from tests.inference.test_architectures import tiny  # noqa: F401 (a fixture)
from tests.inference.test_scheduler import PROMPTS, alone, together

STEPS = 6


def _teacher_forced(resident, decoder_rows):
    """Each row's float32 logits at its prefill and at STEPS decode steps, every row fed the
    tokens its prompt makes alone (so both decoders see the same inputs)."""
    decoder, prompts = decoder_rows
    forced = [alone(resident, prompt, STEPS) for prompt in prompts]
    seen = []
    for step in range(STEPS):
        rows = [tokens[step] if step < len(tokens) else tokens[-1] for tokens in forced]
        seen.append(decoder.step(rows))
    return seen


def _alone_decoder(resident, prompts):
    decoder, logits = BatchedDecoder(resident), []
    for prompt in prompts:
        ids = resident.encode(prompt)
        cache, first = decoder.prefill(ids)
        decoder.admit(cache, len(ids))
        logits.append(first)
    return decoder, torch.stack(logits)


def _together_decoder(resident, prompts):
    decoder = BatchedDecoder(resident)
    cache, mask, logits = decoder.prefill_together([resident.encode(prompt) for prompt in prompts])
    decoder.admit(cache, None, row_mask=mask)
    return decoder, logits


def _assert_together_equals_alone(resident, prompts):
    separate, separate_first = _alone_decoder(resident, prompts)
    joined, joined_first = _together_decoder(resident, prompts)
    assert joined.positions == separate.positions  # each row's real length
    assert joined.mask.sum(dim=1).tolist() == [len(resident.encode(prompt)) for prompt in prompts]
    assert torch.isfinite(joined_first).all()
    torch.testing.assert_close(joined_first, separate_first, rtol=0, atol=1e-4)
    for step, (a, b) in enumerate(zip(_teacher_forced(resident, (joined, prompts)),
                                      _teacher_forced(resident, (separate, prompts)))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=lambda m: f"step {step}: {m}")


def test_one_padded_prefill_gives_each_row_its_own_logits(resident):
    _assert_together_equals_alone(resident, PROMPTS)


def test_one_padded_prefill_on_every_architecture(tiny):  # noqa: F811
    arch, resident = tiny
    _assert_together_equals_alone(resident, PROMPTS[:4])


@pytest.mark.parametrize("seated, group", [(3, (0, 2)), (2, (3, 1))])
def test_a_padded_group_joins_a_lane_with_rows_already_decoding(resident, seated, group):
    """A group merged beside a row seated earlier (wider or narrower than the group) keeps every
    row's logits."""
    prompts = [PROMPTS[seated]] + [PROMPTS[index] for index in group]
    decoder, _ = _alone_decoder(resident, prompts[:1])
    cache, mask, _ = decoder.prefill_together([resident.encode(prompt) for prompt in prompts[1:]])
    decoder.admit(cache, None, row_mask=mask)
    separate, _ = _alone_decoder(resident, prompts)
    assert decoder.positions == separate.positions
    for a, b in zip(_teacher_forced(resident, (decoder, prompts)), _teacher_forced(resident, (separate, prompts))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


class _Recording(BatchedDecoder):
    passes = []  # the prompt lengths of each prefill pass

    def prefill(self, prompt_ids):
        _Recording.passes.append([len(prompt_ids)])
        return super().prefill(prompt_ids)

    def prefill_together(self, prompts):
        _Recording.passes.append([len(prompt) for prompt in prompts])
        return super().prefill_together(prompts)


def _gated(resident, scheduler, jobs):
    """`together`, with the scheduler's thread held until every job waits: they all join at the
    first step boundary (in the order their threads submitted them)."""
    gate = threading.Event()
    scheduler._thread.submit(gate.wait)

    def release():
        deadline = time.monotonic() + 30
        while len(scheduler._waiting) < len(jobs) and time.monotonic() < deadline:
            time.sleep(0.005)
        gate.set()

    threading.Thread(target=release).start()
    return together(resident, scheduler, jobs)


@pytest.mark.parametrize("setting, budget", [("on", 4096), ("auto", 4096), ("off", 4096), ("on", 40)])
def test_the_scheduler_prefills_joiners_together_where_the_policy_says(resident, setting, budget):
    """"on": the joiners of a step boundary in one pass, or (a small budget) in passes whose
    padded tokens stay within it; "auto" in float32 (the suite's dtype) and "off": each alone."""
    assert resident.dtype == torch.float32
    scheduler = StepScheduler(prefill_tokens_per_step=budget, prefill_together=setting)
    scheduler.decoder_class = _Recording
    _Recording.passes = []
    lengths = [8, 10, 5, 8, 10, 3]
    results = _gated(resident, scheduler, [(prompt, n, 0.0, None) for prompt, n in zip(PROMPTS, lengths)])
    for prompt, n, (tokens, seated) in zip(PROMPTS, lengths, results):
        assert tokens == alone(resident, prompt, n), prompt
        assert seated.shared
    passes = _Recording.passes
    assert sorted(length for lengths_ in passes for length in lengths_) == sorted(
        len(resident.encode(prompt)) for prompt in PROMPTS)  # each prompt prefilled once
    if setting == "on" and budget == 4096:
        assert len(passes) == 1
    elif setting == "on":
        joint = [lengths_ for lengths_ in passes if len(lengths_) > 1]
        assert joint and all(len(lengths_) * max(lengths_) <= budget for lengths_ in joint)
        assert len(passes) > 1
    else:
        assert all(len(lengths_) == 1 for lengths_ in passes)
    assert scheduler.live == []


def test_the_policy():
    assert policy.prefills_together("auto", "bfloat16") and policy.prefills_together("auto", "float16")
    assert not policy.prefills_together("auto", "float32")
    assert policy.prefills_together("on", "float32") and not policy.prefills_together("off", "bfloat16")
    assert policy.fits_together(4, 512, 2048) and not policy.fits_together(5, 512, 2048)


def test_a_step_writes_its_keys_in_place_and_a_merge_or_drop_moves_them_to_new_room(resident):
    """The batched cache grows in place (decoding.GrowingLayer): steps after the first reuse one
    buffer per layer, where transformers' layer concatenated the whole cache every step; a merge
    or a drop assigns new tensors, which the next step moves into room of their own; the logits
    equal those of a decoder whose layers concatenate (transformers' own DynamicLayer)."""
    prompts = PROMPTS[:3]
    grown, _ = _together_decoder(resident, prompts)
    plain = BatchedDecoder(resident)
    plain.grows_in_place = False
    cache, mask, _ = plain.prefill_together([resident.encode(prompt) for prompt in prompts])
    plain.admit(cache, None, row_mask=mask)
    assert type(plain.cache.layers[0]) is DynamicLayer and type(grown.cache.layers[0]) is GrowingLayer
    tokens = [alone(resident, prompt, STEPS) for prompt in prompts]
    pointers = []
    for step in range(STEPS):
        rows = [row[min(step, len(row) - 1)] for row in tokens]
        torch.testing.assert_close(grown.step(rows), plain.step(rows), rtol=0, atol=0)
        pointers.append(grown.cache.layers[0].keys.data_ptr())
    assert len(set(pointers[1:])) == 1  # one buffer from the second step on
    assert grown.cache.layers[0].keys.shape == plain.cache.layers[0].keys.shape
    grown.drop([1])
    plain.drop([1])
    before = grown.cache.layers[0].keys.data_ptr()
    rows = [tokens[0][-1], tokens[2][-1]]
    torch.testing.assert_close(grown.step(rows), plain.step(rows), rtol=0, atol=0)
    assert grown.cache.layers[0].keys.data_ptr() != before  # moved into room of its own


class _OutOfMemoryTogether(_Recording):
    """The device's memory as a GPU's would run out: a padded pass of several prompts fails
    (a fault injected into the decoder, the model itself untouched)."""

    def prefill_together(self, prompts):
        _Recording.passes.append("failed")
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def test_a_padded_prefill_out_of_memory_prefills_each_joiner_alone(resident):
    scheduler = StepScheduler(prefill_tokens_per_step=4096, prefill_together="on")
    scheduler.decoder_class = _OutOfMemoryTogether
    _Recording.passes = []
    lengths = [6, 9, 4, 7]
    results = _gated(resident, scheduler, [(prompt, n, 0.0, None) for prompt, n in zip(PROMPTS, lengths)])
    for prompt, n, (tokens, _) in zip(PROMPTS, lengths, results):
        assert tokens == alone(resident, prompt, n), prompt
    assert _Recording.passes[0] == "failed" and _Recording.passes.count("failed") == 1
    assert sorted(len(lengths_) for lengths_ in _Recording.passes[1:]) == [1] * 4  # then each alone
    assert scheduler.live == [] and scheduler.chats.capacity is None
