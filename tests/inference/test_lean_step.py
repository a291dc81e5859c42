"""The lean decode step (lean_step.py) equals the model's own forward pass bit for bit: logits
and the cache it writes, at every step, for left-padded rows with their own positions (the
scheduler's steps) and for one row with no mask (the one-sequence loop's), in float32 and
bfloat16, dense and packed, for Llama and for Gemma 3 (its sliding layers' window, 8 tokens, is
shorter than the prompts and steps); the engine runs it for those two and says so, and every
other architecture runs its own forward."""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from inference_app.catalogue import model_source
from inference_app.engine import attention, lean_step
from inference_app.engine.loader import load_model
from inference_app.engine.runtime import ResidentModel
from tests.inference.test_architectures import tiny, tiny_model_dir  # noqa: F401 (a fixture)
from tests.inference.test_scheduler import PROMPTS

STEPS = 5
TAKEN = {"gemma3"}  # beside the tiny Llama, every other test's model


@pytest.fixture(scope="module")
def gemma3():
    return ResidentModel(load_model(model_source(str(tiny_model_dir("gemma3")))))


def _assert_steps_equal(runtime, model, prompts, masked=True):
    """Prefill the prompts left-padded (the model's own pass), then STEPS greedy steps from two
    copies of that cache: the model's forward on one, the lean step on the other."""
    rows = [runtime.encode(prompt) for prompt in prompts]
    width = max(len(row) for row in rows)
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        # Unmasked, as the one-sequence loop prefills: the model builds its own cache (Gemma 3's
        # sliding layers then keep only the window); masked, the scheduler's whole layers.
        out = model(input_ids=ids, attention_mask=mask if masked else None, position_ids=positions if masked else None,
                    cache=DynamicCache() if masked else None, use_cache=True, logits_to_keep=1)
        theirs, mine = out.cache, copy.deepcopy(out.cache)
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        positions = mask.sum(dim=1, keepdim=True)
        lean = lean_step.LeanStep(model)
        for step in range(STEPS):
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype)], dim=1)
            inputs = dict(attention_mask=mask, position_ids=positions) if masked else {}
            expected = model(input_ids=tokens, cache=theirs, use_cache=True, logits_to_keep=1, **inputs)
            got = lean(input_ids=tokens, cache=mine, use_cache=True, logits_to_keep=1, **inputs)
            assert got.cache is mine
            assert torch.equal(got.logits, expected.logits), f"step {step}"
            for index, (a, b) in enumerate(zip(theirs.layers, mine.layers)):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), f"step {step}, layer {index}"
            tokens = expected.logits[:, -1].argmax(-1, keepdim=True)
            positions = positions + 1


def _assert_equal_in(runtime, dtype, softcapping=None, decode_attention="float32"):
    model = runtime.model
    if dtype != torch.float32 or softcapping is not None:
        model = copy.deepcopy(model).to(dtype)
        model.config.final_logit_softcapping = softcapping
        # A 16-bit model on a CPU attends as the engine loads it (attention.py): `millm_sdpa`
        # where its decode steps attend in float32, transformers' sdpa in the model's dtype.
        expected = attention.NAME if dtype != torch.float32 and decode_attention == "float32" else "sdpa"
        assert attention.use_for(model, torch.device("cpu"), dtype, decode_attention)[0] == expected
    assert lean_step.supports(model)[0]
    _assert_steps_equal(runtime, model, PROMPTS[:4])  # rows of 1 to 13 tokens: padding in most
    _assert_steps_equal(runtime, model, PROMPTS[3:4], masked=False)  # the one-sequence loop's call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_step_equals_the_models_forward_bit_for_bit(resident, dtype):
    _assert_equal_in(resident, dtype)


def test_the_lean_step_equals_the_forward_attending_in_bfloat16(resident):
    _assert_equal_in(resident, torch.bfloat16, decode_attention="model")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_step_equals_gemma3s_forward_bit_for_bit(gemma3, dtype):
    assert isinstance(gemma3.eager_step, lean_step.LeanStep)
    assert set(gemma3.model.config.layer_types) == {"sliding_attention", "full_attention"}
    _assert_equal_in(gemma3, dtype)


def test_the_lean_step_caps_gemma3s_logits_as_its_forward_does(gemma3):
    _assert_equal_in(gemma3, torch.float32, softcapping=1.5)  # below the tiny model's logits: capped


def test_the_engine_runs_it_for_llama_and_its_tokens_are_the_models(resident, monkeypatch):
    assert isinstance(resident.eager_step, lean_step.LeanStep) and resident.decode_forward is resident.eager_step
    assert not resident.compiled and "lean step" in resident.step_words
    steps = []
    monkeypatch.setattr(resident, "eager_step", lambda **arguments: steps.append(1) or lean_step.LeanStep(
        resident.model)(**arguments))
    ids = resident.encode(PROMPTS[0])
    tokens = [token.token_id for token in resident.generate(ids, 8, 0.0, 1.0, 0)]
    assert len(steps) == len(tokens) - 1  # every token after the prefill's came from the eager step
    with torch.inference_mode():  # the same loop on the model's own forward
        expected, cache, last = [], None, ids
        for _ in range(len(tokens)):
            out = resident.model(input_ids=torch.tensor([last]), cache=cache, use_cache=True, logits_to_keep=1)
            expected.append(int(out.logits[0, -1].argmax()))
            cache, last = out.cache, [expected[-1]]
    assert tokens == expected


def test_a_lean_step_that_parts_from_the_forward_is_not_run(resident, monkeypatch):
    """The load's check: one step both ways, and the model's own forward where they differ."""
    assert isinstance(lean_step.eager_step(resident.model)[0], lean_step.LeanStep)
    wrong = staticmethod(lambda norm, hidden: lean_step._llama_norm(norm, hidden) * 1.5)
    monkeypatch.setattr(lean_step._Llama, "norm", wrong)
    step, words = lean_step.eager_step(resident.model)
    assert step is resident.model and "differed" in words


@pytest.mark.parametrize("weights", ["quantized", "blocks"])
def test_the_packaged_gguf_packed_steps_equal_its_forward(default_source, weights):
    """Packed on either kernel, each layer's q, k and v and its gate and up run as one call
    (fused_projections.py), and the steps still equal the model's forward to the bit."""
    runtime = ResidentModel(load_model(default_source, weights=weights))
    assert isinstance(runtime.eager_step, lean_step.LeanStep)
    _assert_steps_equal(runtime, runtime.model, PROMPTS[:3])
    assert all(qkv.joined and gate_up.joined for qkv, gate_up in runtime.eager_step.siblings)


def test_the_k_quant_gemmas_packed_steps_equal_its_forward(second_gguf):
    """Gemma 3 270M Q4_K_M on the block kernel: its gate and up (one GGML type) run as one call,
    its q, k and v as runs of those of one type, and the steps equal the model's forward."""
    runtime = ResidentModel(load_model(model_source(str(second_gguf)), weights="blocks"))
    assert isinstance(runtime.eager_step, lean_step.LeanStep)
    _assert_steps_equal(runtime, runtime.model, PROMPTS[:3])
    assert all(gate_up.joined for _, gate_up in runtime.eager_step.siblings)
    assert any(qkv.joined for qkv, _ in runtime.eager_step.siblings)


def test_other_architectures_run_their_own_forward_and_say_so(tiny):  # noqa: F811
    arch, resident = tiny
    if arch in TAKEN:
        assert isinstance(resident.eager_step, lean_step.LeanStep)
        return
    supported, words = lean_step.supports(resident.model)
    assert not supported and "own forward" in words and type(resident.model).__name__ in words
    assert resident.eager_step is resident.model and resident.step_words == words
