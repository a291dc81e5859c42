"""The compiled decode step (MILLM_COMPILE=decode): two shape buckets compiled at load, and no
compile after that however the scheduler's widths and lengths change, counted.

Whether a step compiles again is dynamo's decision (its guards on the input shapes), the same for
every backend, so the counting tests compile with dynamo's `eager` backend (seconds) and one slow
test runs the production backend, inductor."""

import threading

import pytest
import torch
from django.test import override_settings

from inference_app.engine import quantized, weights
from inference_app.engine.compiled import CompiledStep, bucket_widths
from inference_app.engine.decoding import BatchedDecoder
from inference_app.engine.runtime import ResidentModel
from inference_app.engine.scheduler import SeatedRuntime, StepScheduler
from tests.inference.test_quantized import tiny_packed  # noqa: F401 (a fixture)

# One-token prompts (one cache column), short and long ones, joining and leaving at any width.
PROMPTS = [[7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [21, 22], [5], [30, 31, 32, 33], [40, 41, 42, 43, 44, 45]]
LENGTHS = [9, 4, 12, 3, 7, 5]


@pytest.fixture(scope="module")
def compiled_runtime(resident):
    """A second runtime over the tiny model's weights, its decode step compiled."""
    runtime = ResidentModel(resident.loaded)
    runtime.compile_decode_step(backend="eager")
    return runtime


def greedy_together(runtime, prompts, lengths):
    """Every prompt decoded greedily through one scheduler, each consumed in a thread of its own."""
    scheduler = StepScheduler(prefill_tokens_per_step=16)  # a few joiners a step: widths change
    results = [None] * len(prompts)

    def consume(index):
        seated = SeatedRuntime(runtime, scheduler, interactive=True)
        results[index] = [token.token_id for token in seated.generate(prompts[index], lengths[index], 0.0, 1.0, None)]

    threads = [threading.Thread(target=consume, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def test_the_two_buckets_compile_at_load_and_steady_traffic_never_compiles_again(resident, compiled_runtime):
    step = compiled_runtime.decode_forward
    assert isinstance(step, CompiledStep)
    assert step.warm_compiles == 2 and step.compile_seconds > 0  # one row; two rows or more
    for _ in range(2):
        tokens = greedy_together(compiled_runtime, PROMPTS, LENGTHS)
        lone = [greedy_together(compiled_runtime, [prompt], [length])[0] for prompt, length in zip(PROMPTS, LENGTHS)]
        assert step.recompiles == 0
        assert [len(row) for row in tokens] == LENGTHS
    # The eager backend runs the traced graph as it is: the same tokens as the uncompiled model.
    assert tokens == lone == greedy_together(resident, PROMPTS, LENGTHS)


def test_a_one_token_prompt_gets_a_masked_column_and_the_same_logits(resident, compiled_runtime):
    logits = {}
    for runtime in (resident, compiled_runtime):
        decoder = BatchedDecoder(runtime)
        cache, first = decoder.prefill([9])
        decoder.admit(cache, 1)
        logits[runtime] = decoder.step([int(first.argmax())])
        assert decoder.width == (2 if runtime is resident else 3)  # the compiled step padded a column
        assert decoder.positions == [2]
    assert torch.equal(logits[resident], logits[compiled_runtime])
    assert compiled_runtime.decode_forward.recompiles == 0


def test_a_packed_width_rule_is_one_more_bucket_and_an_edit_compiles_once_more(tiny_packed):  # noqa: F811
    loaded, cache = tiny_packed
    quantized.pack(loaded.model, None, "quantized", cache=cache)
    for module in quantized.packed_modules(loaded.model):
        module.max_rows = 3  # as `auto` leaves a projection the kernel wins on up to 3 rows
    assert bucket_widths(loaded.model) == [1, 2, 4]
    runtime = ResidentModel(loaded)
    runtime.compile_decode_step(backend="eager")
    step = runtime.decode_forward
    assert step.warm_compiles == 3
    greedy_together(runtime, PROMPTS, LENGTHS)  # widths 1 to 6 and back
    assert step.recompiles == 0
    # An edit runs one projection dense from then on: the graph traced over it compiles again.
    target = loaded.model.model.layers[0].mlp.down_proj
    weights.write(loaded.model, {"model.layers.0.mlp.down_proj.weight": target.weight.detach().clone()})
    greedy_together(runtime, PROMPTS[:1], LENGTHS[:1])
    assert step.recompiles == 1


def test_the_fingerprint_says_the_decode_step_is_compiled(resident, compiled_runtime):
    assert "+compiled:" in compiled_runtime.fingerprint
    assert "+compiled" not in resident.fingerprint


@pytest.mark.slow
def test_the_setting_compiles_through_inductor_at_load_with_no_recompiles(resident):
    with override_settings(MILLM_COMPILE="decode"):
        runtime = ResidentModel(resident.loaded)
    step = runtime.decode_forward
    assert step.backend == "inductor" and step.warm_compiles == 2
    tokens = greedy_together(runtime, PROMPTS, LENGTHS)
    assert step.recompiles == 0
    decoders = {}
    for name, each in (("eager", resident), ("compiled", runtime)):
        decoder = decoders[name] = BatchedDecoder(each)
        for prompt in PROMPTS[:3]:
            cache, _ = decoder.prefill(prompt)
            decoder.admit(cache, len(prompt))
    # Kernel order may differ under inductor: close, not equal.
    torch.testing.assert_close(decoders["compiled"].step([1, 2, 3]), decoders["eager"].step([1, 2, 3]),
                               rtol=1e-4, atol=1e-4)
    assert [len(row) for row in tokens] == LENGTHS
