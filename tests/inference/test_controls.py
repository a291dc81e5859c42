"""The sampling controls (issue 29, point 4): logit_bias and the presence and frequency penalties,
as OpenAI defines them, on the tiny model in both of its decoding loops (the resident model's own
and the step scheduler's shared steps), and their refusals."""

import pytest
import torch

from inference_app.engine import services
from inference_app.engine.controls import Controls
from inference_app.engine.scheduler import StepScheduler
from inference_app.schemas import parse_request
from millm_lib.errors import ApiError
from tests.inference.test_scheduler import PROMPTS, alone, together

CHAT = "/v1/chat/completions"
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def controls(**fields):
    return Controls.of(parse_request(CHAT, {**BASE, **fields}, strict=True).request)


def tokens(runtime, prompt, max_tokens, control, temperature=0.0, seed=None):
    return [token.token_id for token in runtime.generate(runtime.encode(prompt), max_tokens, temperature, 1.0, seed,
                                                         controls=control)]


def test_no_control_or_only_neutral_values_is_none():
    assert controls() is None
    assert controls(logit_bias={}, presence_penalty=0, frequency_penalty=0) is None
    assert controls(logit_bias={"7": 0}) is None


def test_the_adjustment_is_openais_formula_and_leaves_the_callers_row_alone():
    row = torch.zeros(10)
    adjusted = controls(logit_bias={"2": 5, "9": -100}, presence_penalty=0.5, frequency_penalty=1.5).apply(row, [3, 3, 2, 7])
    # bias[j] - c[j] * frequency - (c[j] > 0) * presence
    expected = torch.zeros(10)
    expected[2] = 5 - 1 * 1.5 - 0.5
    expected[9] = -100
    expected[3] = -2 * 1.5 - 0.5
    expected[7] = -1 * 1.5 - 0.5
    assert torch.equal(adjusted, expected)
    assert torch.equal(row, torch.zeros(10))


def test_a_bias_of_100_forces_its_token_alone_and_among_others(resident):
    forced = next(token for token in range(100, 200) if not resident.is_eos(token))
    control = controls(logit_bias={str(forced): 100})
    assert tokens(resident, PROMPTS[0], 6, control) == [forced] * 6
    assert tokens(resident, PROMPTS[0], 6, controls(logit_bias={str(forced): -100})) != [forced] * 6

    scheduler = StepScheduler(prefill_tokens_per_step=4096)
    results = together(resident, scheduler, [(PROMPTS[0], 6, 0.0, None), (PROMPTS[1], 6, 0.0, None)],
                       controls=[control, None])
    assert results[0][0] == [forced] * 6
    assert results[1][0] == alone(resident, PROMPTS[1], 6)  # a row without controls is its own greedy answer


def test_penalties_change_a_repeating_greedy_answer_the_same_way_in_both_loops(resident):
    plain = alone(resident, PROMPTS[4], 12)
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself: penalties have work to do
    for fields in ({"frequency_penalty": 2}, {"presence_penalty": 2}):
        penalised = tokens(resident, PROMPTS[4], 12, controls(**fields))
        assert penalised != plain, fields
        assert len(set(penalised)) > len(set(plain)), fields
        scheduler = StepScheduler(prefill_tokens_per_step=4096)
        seated = together(resident, scheduler, [(PROMPTS[4], 12, 0.0, None), (PROMPTS[2], 5, 0.0, None)],
                          controls=[controls(**fields), None])
        assert seated[0][0] == penalised, fields  # float32: the shared step gives the loop's tokens
    # a negative penalty encourages repeats
    assert len(set(tokens(resident, PROMPTS[4], 12, controls(frequency_penalty=-2)))) <= len(set(plain))


def test_seeded_sampling_with_controls_is_reproducible(resident):
    control = controls(logit_bias={"100": 3, "101": 3}, presence_penalty=1)
    first = tokens(resident, PROMPTS[3], 10, control, temperature=1.0, seed=7)
    assert first == tokens(resident, PROMPTS[3], 10, control, temperature=1.0, seed=7)
    scheduler = StepScheduler(prefill_tokens_per_step=4096)
    seated = together(resident, scheduler, [(PROMPTS[3], 10, 1.0, 7), (PROMPTS[0], 8, 1.0, 3)], controls=[control, None])
    assert seated[0][0] == first


def refusal(body):
    with pytest.raises(ApiError) as caught:
        parse_request(CHAT, {**BASE, **body}, strict=True)
    return caught.value


@pytest.mark.parametrize("body,param,words", [
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc", "[0-9]"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias.5", "100"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "300"),
    ({"presence_penalty": 2.5}, "presence_penalty", "2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "-2"),
])
def test_out_of_range_controls_are_400_naming_the_field_and_the_limit(body, param, words):
    error = refusal(body)
    assert (error.status, error.code) == (400, "invalid_parameter")
    assert error.param == param and words in error.message


def test_scoring_mode_refuses_controls_it_would_not_apply():
    error = refusal({"logprobs": True, "max_tokens": 1, "logit_bias": {"5": 1}})
    assert (error.code, error.param) == ("field_not_honoured", "logit_bias")


def test_a_biased_token_outside_the_vocabulary_is_400_before_any_forward_pass(resident):
    body = {"model": resident.model_id, "messages": [{"role": "user", "content": "hi"}],
            "logit_bias": {str(resident.vocab_size): 5}}
    with pytest.raises(ApiError) as caught:
        services.run(resident, parse_request(CHAT, body, strict=True))
    assert caught.value.param == "logit_bias" and str(resident.vocab_size) in caught.value.message


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30])
def test_a_tiny_temperature_samples_the_largest_logit_instead_of_failing_on_nan(temperature):
    # The fuzz found it (a /v1/responses body of temperature 5e-324): logits / temperature was
    # inf - inf = NaN in the softmax, and the sequence failed. The limit is greedy decoding.
    from inference_app.engine.runtime import ResidentModel

    logits = torch.tensor([1.0, 3.5, -2.0, float("-inf"), 3.4])
    generator = torch.Generator().manual_seed(0)
    assert {ResidentModel._sample(logits, temperature, 1.0, generator) for _ in range(20)} == {1}
    assert ResidentModel._sample(logits, temperature, 0.5, generator) == 1
