"""Every architecture with a tiny random config loads through the production loader and batches
(issue 44): greedy tokens decoded together equal the tokens each prompt makes alone, in float32,
with the rows sharing forward passes. The sliding-window ones (Mistral, Gemma 2 and 3) have a
window of 8 tokens, shorter than the prompts and answers here, so the window is exercised."""

import fcntl

import pytest
import transformers
from django.core.management import call_command

from inference_app.catalogue import model_source
from inference_app.engine import decoding
from inference_app.engine.loader import load_model
from inference_app.engine.runtime import ResidentModel
from inference_app.engine.scheduler import StepScheduler
from inference_app.management.commands.createtestmodel import ARCHITECTURES
from tests.conftest import TEST_MODEL_DIR
from tests.inference.test_scheduler import PROMPTS, alone, together

OTHERS = sorted(set(ARCHITECTURES) - {"llama"})  # the tiny Llama is every other test's model


def tiny_model_dir(arch):
    folder = TEST_MODEL_DIR.with_name(f"tiny-{arch}")
    with open(TEST_MODEL_DIR.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "model.safetensors").exists():
            staging = folder.with_name(f"tiny-{arch}.partial")
            call_command("createtestmodel", str(staging), arch=arch)
            staging.rename(folder)
    return folder


@pytest.fixture(scope="module", params=OTHERS)
def tiny(request):
    TEST_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    return request.param, ResidentModel(load_model(model_source(str(tiny_model_dir(request.param)))))


def test_each_architecture_loads_and_its_rows_share_steps_with_the_tokens_they_make_alone(tiny):
    arch, resident = tiny
    assert resident.model.config.model_type.startswith(arch)  # gemma3: "gemma3_text"
    assert resident.batches, resident.decoding
    scheduler = StepScheduler(prefill_tokens_per_step=4096)
    lengths = [12, 16, 7, 14]
    results = together(resident, scheduler, [(prompt, n, 0.0, None) for prompt, n in zip(PROMPTS, lengths)])
    for prompt, n, (tokens, _) in zip(PROMPTS, lengths, results):
        assert tokens == alone(resident, prompt, n), (arch, prompt)
    assert scheduler.steps < sum(lengths)  # the rows shared forward passes
    assert sum(seated.shared for _, seated in results) >= 2


def test_a_sliding_window_model_says_so_and_one_with_state_layers_decodes_serially_and_says_why():
    sliding, words = decoding.batches(transformers.Gemma3TextConfig(sliding_window=8))
    assert sliding and "sliding-window" in words
    assert decoding.batches(transformers.LlamaConfig()) == (True, "batched")
    serial, why = decoding.batches(transformers.Qwen3NextConfig())
    assert not serial and why.startswith("serial") and "linear_attention" in why
