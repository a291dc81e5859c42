"""The model a user brings (issue 44), end to end: Gemma 3 270M in Q4_K_M, a non-Llama
architecture with sliding-window layers and no chat template in its file, served by real
processes. Without a template chat is a 400 naming the setting and completions answer; registered
with a template it chats in that template; 8 requests at once share decode steps; a packed
scoring batch and a batched generation batch complete."""

import concurrent.futures
import dataclasses
from pathlib import Path

import httpx
import jinja2
import pytest

from tests.conftest import ROOT
from tests.e2e.batch_helpers import CHAT, line, read_jsonl, start_batch, wait_for
from tests.e2e import test_hostile_inputs as hostile
from tests.e2e.conftest import make_client
from tests.e2e.stack import Stack

MODEL = "gemma-3-270m"
CHATTING = "gemma-3-270m-chat"  # the same file, registered with MILLM_CHAT_TEMPLATE's value "gemma"
SEATS = 9
QUESTION = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, second_gguf):
    work = tmp_path_factory.mktemp("second-model")
    # The conversion cache the in-process tests fill (its key is the file's path, size and
    # time): the stack converts nothing again. Its folders are renamed into place whole.
    (work / "data").mkdir()
    (work / "data" / "model-cache").symlink_to(ROOT / "var" / "model-cache", target_is_directory=True)
    settings = {"MILLM_MODEL_ID": MODEL, "ENGINE_MAX_SEQUENCES": SEATS, "BATCH_WAIT_POLL_S": 0.2}
    with Stack.running(work, second_gguf, **settings) as stack:
        stack.client = make_client(stack.web.url)
        yield stack


def post(stack, path, body):
    return httpx.post(stack.web.url + path, json=body, timeout=120)


def test_chat_without_a_template_is_a_400_naming_the_setting_and_completions_still_answer(gemma):
    refused = post(gemma, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 4})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "chat_template_missing" and "MILLM_CHAT_TEMPLATE" in error["message"]
    answered = post(gemma, "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                                                "temperature": 0})
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] >= 1


def test_eight_requests_at_once_share_decode_steps(gemma):
    def ask(index):
        return post(gemma, "/v1/completions", {"model": MODEL, "prompt": f"Item {index}: once upon a time",
                                                "max_tokens": 24, "temperature": 0})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert [answer.status_code for answer in answers] == [200] * 8
    backends = [answer.headers["X-miLLM-Backend"] for answer in answers]
    assert backends.count("batched") >= 7, backends  # the first may finish its prefill alone


def test_registered_with_a_template_it_chats_in_that_template(gemma, second_gguf):
    registered = post(gemma, "/api/models", {"source": str(second_gguf), "id": CHATTING, "chat_template": "gemma"})
    assert registered.status_code == 201 and registered.json()["data"]["chat_template"] == "gemma"
    chat = post(gemma, "/v1/chat/completions", {"model": CHATTING, "messages": QUESTION, "max_tokens": 6, "temperature": 0})
    assert chat.status_code == 200, chat.text
    # The same prompt rendered by the template's own file and sent as a completion: the same
    # tokens in, so the same greedy answer out.
    template = Path(ROOT / "inference_app" / "chat_template_files" / "gemma.jinja").read_text()
    rendered = jinja2.Environment().from_string(template).render(messages=QUESTION, bos_token="<bos>",
                                                                add_generation_prompt=True)
    assert rendered.startswith("<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is")
    completion = post(gemma, "/v1/completions", {"model": CHATTING, "prompt": rendered, "max_tokens": 6, "temperature": 0})
    assert chat.json()["usage"]["prompt_tokens"] == completion.json()["usage"]["prompt_tokens"]
    assert chat.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]


def test_a_packed_scoring_batch_and_a_batched_generation_batch_complete(gemma):
    client = gemma.client
    scoring = [line(f"score-{i}", CHAT, {"model": CHATTING, "max_tokens": 1, "logprobs": True, "top_logprobs": 2,
                                         "messages": [{"role": "user", "content": f"Is {i} even? " * (1 + i % 3)}]})
               for i in range(12)]
    generation = [line(f"gen-{i}", CHAT, {"model": CHATTING, "max_tokens": 12 + i % 4, "temperature": 0,
                                          "messages": [{"role": "user", "content": f"Tell me about item {i}"}]})
                  for i in range(8)]
    packed = start_batch(client, scoring, CHAT, extra_body={"pack": True})
    batched = start_batch(client, generation, CHAT, extra_body={"batched_decoding": True})
    packed, batched = wait_for(client, packed.id, timeout=300), wait_for(client, batched.id, timeout=300)
    assert (packed.status, batched.status) == ("completed", "completed")
    scored = read_jsonl(client, packed.output_file_id)
    assert len(scored) == 12 and all(row["response"]["status_code"] == 200 for row in scored)
    assert any(row["response"]["millm"]["packed"] for row in scored)
    made = read_jsonl(client, batched.output_file_id)
    assert len(made) == 8 and all(row["response"]["status_code"] == 200 for row in made)
    assert sum(row["response"]["millm"]["batched"] for row in made) >= 2



def test_embeddings_scoring_and_a_probe_answer_on_it(gemma, second_gguf):
    registered = post(gemma, "/api/models", {"source": str(second_gguf), "id": CHATTING, "chat_template": "gemma"})
    assert registered.status_code in (201, 409), registered.text
    embedded = post(gemma, "/v1/embeddings", {"model": CHATTING, "input": ["a lighthouse", "the sea at night"]})
    assert embedded.status_code == 200, embedded.text
    vectors = [item["embedding"] for item in embedded.json()["data"]]
    assert [len(vector) for vector in vectors] == [640, 640] and vectors[0] != vectors[1]  # Gemma 270M's width
    scored = post(gemma, "/v1/chat/completions", {"model": CHATTING, "max_tokens": 1, "logprobs": True, "top_logprobs": 3,
                                                   "messages": [{"role": "user", "content": "Is Paris in France? Yes or no."}]})
    assert scored.status_code == 200, scored.text
    top = scored.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == 3 and top == sorted(top, key=lambda item: -item["logprob"])
    probe = post(gemma, "/api/probes", {"name": "second", "model": CHATTING, "layer": 9, "aggregation": "mean",
                                        "weights": [0.01] * 640})
    assert probe.status_code == 201, probe.text
    verdicts = post(gemma, "/api/probes/score", {"probe_ids": [probe.json()["data"]["id"]],
                                                  "inputs": [{"text": "I loved this film."}]})
    assert verdicts.status_code == 200, verdicts.text
    (result,) = verdicts.json()["data"]["results"]
    assert all(isinstance(verdict["score"], float) for verdict in result["verdicts"] if verdict["window"] == "all")

# The hostile corpus's cases for the routes that reach the model (issue 44), on this model. Four
# of them are about the tiny model's sizes (its 1,024-token context, its 64-wide hidden state,
# its 2 layers): on this model they are answered by its own sizes, and only "never a 5xx" holds.
MODEL_ROUTES = (hostile.CHAT, hostile.COMPLETIONS, hostile.EMBEDDINGS, hostile.RESPONSES, "/v1/models/", "/api/models",
                "/api/probes")
SIZED = {"completions: a prompt over the context", "embeddings: an input over the context",
         "probes: a layer of 10^30", "probes: the wrong width"}
ON_THE_MODEL = [case for case in hostile.CORPUS if case.path.startswith(MODEL_ROUTES) and hostile.FILE_ID not in case.path
                and not (isinstance(case.body, str) and hostile.FILE_ID in case.body)]


def on_this_model(case):
    """The case with the tiny model's id swapped for the chatting Gemma's."""
    body = case.body.replace(hostile.MODEL_ID, CHATTING) if isinstance(case.body, str) else case.body
    return dataclasses.replace(case, path=case.path.replace(hostile.MODEL_ID, CHATTING), body=body)


def test_the_corpus_reaches_the_model_routes():
    assert len(ON_THE_MODEL) >= 60
    assert {route for route in MODEL_ROUTES if any(case.path.startswith(route) for case in ON_THE_MODEL)} == set(MODEL_ROUTES)


@pytest.fixture(scope="module")
def chatting(gemma, second_gguf):
    """The file registered as CHATTING (by the template test, or here when a case runs alone)."""
    registered = post(gemma, "/api/models", {"source": str(second_gguf), "id": CHATTING, "chat_template": "gemma"})
    assert registered.status_code in (201, 409), registered.text
    return gemma


@pytest.mark.parametrize("case", ON_THE_MODEL, ids=[case.name for case in ON_THE_MODEL])
def test_hostile_input_on_this_model_gets_its_documented_4xx(chatting, case):
    case = on_this_model(case)
    headers = {**({"Content-Type": case.content_type} if case.body is not None else {}), **case.headers}
    response = httpx.request(case.method, chatting.web.url + case.path, content=case.body, headers=headers, timeout=120)
    if case.name in SIZED:
        assert response.status_code < 500, response.text[:500]
    else:
        hostile.assert_envelope(response, case.path, case.status, case.code, case.param, case.says)


def test_after_the_corpus_the_model_still_answers_and_no_process_logged_an_error(gemma):
    chat = post(gemma, "/v1/chat/completions", {"model": CHATTING, "messages": QUESTION, "max_tokens": 2})
    assert chat.status_code == 200
    assert gemma.web.alive and gemma.engine.alive
    assert "Internal Server Error" not in gemma.web.log() and "unhandled error" not in gemma.web.log()
    assert "Traceback" not in gemma.engine.log()
