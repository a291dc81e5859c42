"""Decode-step attention in float32 for a 16-bit model on a CPU (attention.py, SPEC 7a): the tiny
model through the production loader, in float32 and in bfloat16."""

import copy
import json

import pytest
import torch
from django.conf import settings

from inference_app.catalogue import model_source
from inference_app.engine import attention
from inference_app.engine.decoding import BatchedDecoder
from inference_app.engine.loader import load_model
from inference_app.engine.runtime import ResidentModel

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bfloat16_resident(test_model_dir):
    """Decode steps attending in float32 (ENGINE_DECODE_ATTENTION=float32), whatever this CPU's
    timing would choose."""
    before, settings.ENGINE_DECODE_ATTENTION = settings.ENGINE_DECODE_ATTENTION, "float32"
    try:
        return ResidentModel(load_model(model_source(str(test_model_dir)), CPU, torch.bfloat16))
    finally:
        settings.ENGINE_DECODE_ATTENTION = before


def test_a_float32_model_keeps_transformers_sdpa(resident):
    assert resident.model.config._attn_implementation == "sdpa"


def test_a_bfloat16_model_on_a_cpu_attends_through_millm_sdpa(bfloat16_resident):
    assert bfloat16_resident.model.config._attn_implementation == attention.NAME


@pytest.mark.parametrize("setting, expected", [("float32", attention.NAME), ("model", "sdpa")])
def test_the_setting_chooses_the_decode_attention(bfloat16_resident, setting, expected):
    model = copy.deepcopy(bfloat16_resident.model)
    model.set_attn_implementation("sdpa")
    kind, why = attention.use_for(model, CPU, torch.bfloat16, setting)
    assert kind == expected == model.config._attn_implementation and "ENGINE_DECODE_ATTENTION" in why


@pytest.mark.parametrize("times, expected", [((2.0, 1.0), "sdpa"), ((1.0, 0.95), attention.NAME),
                                             ((1.0, 2.0), attention.NAME)])
def test_auto_attends_in_the_models_dtype_only_where_it_timed_clearly_faster(bfloat16_resident, monkeypatch,
                                                                             times, expected):
    """`auto` times both forms for the model's heads (here the timing's result is given, to see
    each side of the rule; the next test times for real)."""
    model = copy.deepcopy(bfloat16_resident.model)
    model.set_attn_implementation("sdpa")
    monkeypatch.setattr(attention, "_decode_times", lambda config, dtype: times)
    kind, why = attention.use_for(model, CPU, torch.bfloat16, "auto")
    assert kind == expected and "timed" in why


def test_auto_times_the_models_own_heads(bfloat16_resident):
    config = bfloat16_resident.model.config
    mine, theirs = attention._decode_times(config, torch.bfloat16, repeats=2)
    assert 0 < mine < 1 and 0 < theirs < 1
    float32_model = copy.deepcopy(bfloat16_resident.model).float()
    float32_model.set_attn_implementation("sdpa")
    assert attention.use_for(float32_model, CPU, torch.float32, "auto") == ("sdpa", "")  # nothing to choose


def _decode_logits(resident, prompts, steps=3):
    """Greedy rows decoded together; the last step's logits."""
    decoder, rows = BatchedDecoder(resident), []
    for prompt in prompts:
        cache, logits = decoder.prefill(prompt)
        decoder.admit(cache, len(prompt))
        rows.append([int(torch.argmax(logits))])
    for _ in range(steps):
        logits = decoder.step([row[-1] for row in rows])
        for row, token in zip(rows, torch.argmax(logits, dim=-1).tolist()):
            row.append(token)
    return logits


def _decode_logits_under(resident, prompts, name, function):
    """`_decode_logits` with attention `function` registered as `name`; millm_sdpa again after."""
    attention.AttentionInterface.register(name, function)
    attention.AttentionMaskInterface.register(name, attention.sdpa_mask)
    try:
        resident.model.set_attn_implementation(name)
        return _decode_logits(resident, prompts)
    finally:
        resident.model.set_attn_implementation(attention.NAME)


def _float32_by_hand(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """A decode step's attention written out in float32 (a prefill runs transformers' sdpa)."""
    if query.shape[2] != 1:
        return attention.sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    q = query.float()
    k, v = key.float().repeat_interleave(groups, dim=1), value.float().repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
            else scores + attention_mask
    output = torch.softmax(scores, dim=-1) @ v
    return output.transpose(1, 2).contiguous().to(query.dtype), None


def test_decode_steps_attend_in_float32_and_prefills_as_sdpa(bfloat16_resident):
    """A decode step under millm_sdpa equals the same step with float32 attention computed by
    hand from the same bfloat16 projections; a prefill is bit for bit transformers' sdpa."""
    model = bfloat16_resident.model
    prompts = [bfloat16_resident.encode(text) for text in ("The lighthouse keeper", "Once upon a time, far away")]
    seen = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        output, weights = attention.attention(module, query, key, value, attention_mask, **kwargs)
        seen.append((query.shape[2], query.dtype, output.dtype))
        return output, weights

    ours = _decode_logits_under(bfloat16_resident, prompts, "recording", recording)
    assert {(queries, dtype, out) for queries, dtype, out in seen if queries == 1} == {(1, torch.bfloat16, torch.bfloat16)}
    assert any(queries > 1 for queries, _, _ in seen)  # the prefills went through it too

    model.set_attn_implementation("sdpa")
    try:
        theirs = _decode_logits(bfloat16_resident, prompts)
        ids = torch.tensor([prompts[1]])
        sdpa_prefill = model(input_ids=ids, use_cache=False).logits
    finally:
        model.set_attn_implementation(attention.NAME)
    ours_prefill = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(ours_prefill, sdpa_prefill)

    # The float32 reference, by hand: softmax(q k^T * scale + mask) v on float32 copies of the
    # same bfloat16 projections at each decode step, rounded back to bfloat16.
    reference = _decode_logits_under(bfloat16_resident, prompts, "float32_by_hand", _float32_by_hand)
    # millm_sdpa is that reference up to float32's own rounding; sdpa in bfloat16 is further off.
    ours_off, theirs_off = (ours - reference).abs().max(), (theirs - reference).abs().max()
    assert ours_off < theirs_off / 4, (float(ours_off), float(theirs_off))
    # Same model, attention rounded differently: close, and not the same bits (it would be, if
    # millm_sdpa attended in bfloat16 after all).
    assert torch.allclose(ours, theirs, atol=0.1, rtol=0.05)
    assert not torch.equal(ours, theirs)


def test_a_saved_configuration_names_no_attention_of_ours(bfloat16_resident, tmp_path):
    """A checkpoint written from the engine loads anywhere: the private choice is not saved."""
    bfloat16_resident.model.config.save_pretrained(tmp_path)
    assert attention.NAME not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
