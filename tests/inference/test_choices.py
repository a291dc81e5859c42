"""`n` choices (issue 29, point 4): each choice is its own sequence, all from one prefill, seeded
seed + i; alone on the resident model and seated under the step scheduler alike, streamed by
index, each with its own grammar state."""

import json

import jsonschema
import pytest

from inference_app.engine import services
from inference_app.engine.decoding import BatchedDecoder
from inference_app.engine.scheduler import SeatedRuntime, StepScheduler
from inference_app.schemas import parse_request
from tests.inference.test_grammars import SCHEMA, schema_format

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat(resident, **fields):
    return {"model": resident.model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "temperature": 1.0, "seed": 5, **fields}


def texts(body):
    return [choice["message"]["content"] for choice in body["choices"]]


def run(runtime, body, endpoint=CHAT):
    return services.run(runtime, parse_request(endpoint, body, strict=True)).body


@pytest.fixture
def seated(resident):
    scheduler = StepScheduler(prefill_tokens_per_step=64)
    return lambda: SeatedRuntime(resident, scheduler, interactive=True)


def test_choice_i_is_the_single_answer_seeded_seed_plus_i_alone_and_seated(resident, seated):
    singles = [run(resident, chat(resident, seed=5 + index)) for index in range(3)]
    expected = [texts(single)[0] for single in singles]
    answer = run(resident, chat(resident, n=3))
    assert texts(answer) == expected and len(set(expected)) == 3
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    assert answer["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == sum(single["usage"]["completion_tokens"] for single in singles)
    runtime = seated()
    assert texts(run(runtime, chat(resident, n=3))) == expected
    assert runtime.shared  # the choices decoded in the same steps


def test_seated_choices_share_one_prefill(resident, seated, monkeypatch):
    prefills = []
    original = BatchedDecoder.prefill
    monkeypatch.setattr(BatchedDecoder, "prefill", lambda self, ids: prefills.append(len(ids)) or original(self, ids))
    run(seated(), chat(resident, n=4))
    assert len(prefills) == 1
    run(seated(), chat(resident))
    assert len(prefills) == 2


def test_streamed_choices_join_by_index_to_the_whole_answers(resident, seated):
    expected = texts(run(resident, chat(resident, n=3)))
    _, chunks = services.stream(seated(), parse_request(CHAT, chat(resident, n=3, stream=True), strict=True))
    joined, finished = ["", "", ""], {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            joined[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finished[choice["index"]] = choice["finish_reason"]
    assert joined == expected and set(finished) == {0, 1, 2}


def test_completions_give_n_choices_per_prompt_in_prompt_order(resident):
    body = {"model": resident.model_id, "prompt": ["One", "Two"], "max_tokens": 4, "n": 2, "seed": 1}
    answer = run(resident, body, COMPLETIONS)
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2, 3]
    for prompt_index, prompt in enumerate(["One", "Two"]):
        for choice in range(2):
            alone = run(resident, {**body, "prompt": prompt, "n": 1, "seed": 1 + choice}, COMPLETIONS)
            assert answer["choices"][prompt_index * 2 + choice]["text"] == alone["choices"][0]["text"]


def test_each_choice_keeps_its_own_grammar_and_a_stop_ends_one_choice_only(resident, seated):
    answer = run(seated(), chat(resident, n=3, max_tokens=120, response_format=schema_format()))
    for content in texts(answer):
        jsonschema.validate(json.loads(content), SCHEMA)
    # Two seeded choices that differ: a stop found in the first's text and not in the second's
    # ends the first only; the second runs to its length, exactly as without the stop.
    sampled = {"n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 12}
    first = texts(run(seated(), chat(resident, **sampled)))
    assert first[0] != first[1]
    stop = next(first[0][start:start + 3] for start in range(2, len(first[0]) - 3)
                if first[0][start:start + 3] not in first[1] and first[0][start:start + 3].strip())
    stopped = run(seated(), chat(resident, **sampled, stop=[stop]))
    assert [choice["finish_reason"] for choice in stopped["choices"]] == ["stop", "length"]
    assert texts(stopped) == [first[0][: first[0].index(stop)], first[1]]
