"""Shared prefixes computed once (issue 45), end to end on real processes (float32, the tiny
model): a batch's `prefix_reuse` rows say how much they reused and answer as rows run whole do;
a chat's next turn begins from its earlier turn's prefix (MILLM_PREFIX_REUSE); the opt-in's
refusals name the field."""

import time

import httpx
import pytest

from inference_app.engine.prefix_cache import BLOCK_TOKENS
from tests.e2e.batch_helpers import line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.model_helpers import api, wait_resident
from tests.e2e.stack import Stack

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
INSTRUCTION = ("You are an annotator. Read the text below and label it positive, negative or neutral, weighing "
               "each word the writer chose and the tone of every sentence before you answer. ") * 2
TEXTS = ["I loved it.", "Terrible, and cold too.", "It was fine, I suppose, nothing more to say about it.", "Meh",
         "Best day of my life!"]


@pytest.fixture(scope="module")
def reusing(tmp_path_factory, test_model_dir):
    """Seats for generation, and interactive prefix reuse on."""
    settings = {"ENGINE_MAX_SEQUENCES": 4, "MAX_PENDING_REQUESTS": 8, "BATCH_WAIT_POLL_S": 0.2,
                "MILLM_PREFIX_REUSE": "true", "BATCH_PACK_MAX_ROWS": 4}
    with Stack.running(tmp_path_factory.mktemp("prefix"), test_model_dir, **settings) as stack:
        stack.client = make_client(stack.web.url)
        yield stack


def scoring(text):
    return {"model": MODEL_ID, "prompt": INSTRUCTION + "Text: " + text + "\nLabel:", "max_tokens": 1, "logprobs": 3}


def test_a_scoring_batch_reuses_its_instruction_in_every_chunk(reusing):
    client, url = reusing.client, reusing.web.url
    texts = TEXTS * 2  # ten rows, packs of at most 4: three chunks
    rows = [line(f"s{i}", COMPLETIONS, scoring(text)) for i, text in enumerate(texts)]
    rows.append(line("short", COMPLETIONS, {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "logprobs": 3}))
    done = wait_for(client, start_batch(client, rows, COMPLETIONS, extra_body={"pack": True, "prefix_reuse": True}).id)
    assert done.status == "completed"
    batch = httpx.get(f"{url}/v1/batches/{done.id}").json()
    assert batch["millm"]["prefix_reuse"] is True
    output = {row["custom_id"]: row for row in read_jsonl(client, done.output_file_id)}
    reused = {custom_id: row["response"]["millm"]["prefix_tokens_reused"] for custom_id, row in output.items()}
    assert all(reused[f"s{i}"] >= 32 and reused[f"s{i}"] % BLOCK_TOKENS == 0 for i in range(len(texts))), reused
    assert reused["short"] == 0  # a row shorter than the shared prefix runs whole
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == sum(reused.values())
    for i, text in enumerate(texts):
        body = output[f"s{i}"]["response"]["body"]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == reused[f"s{i}"]
        sync = httpx.post(url + COMPLETIONS, json=scoring(text)).json()["choices"][0]["logprobs"]
        mine = body["choices"][0]["logprobs"]
        assert mine["tokens"] == sync["tokens"]
        for token, value in sync["top_logprobs"][0].items():
            assert mine["top_logprobs"][0][token] == pytest.approx(value, abs=1e-4)
    metrics = httpx.get(url + "/metrics").text
    cached = [row for row in metrics.splitlines() if row.startswith('millm_batch_tokens{kind="cached"}')]
    assert cached and float(cached[0].split()[-1]) >= sum(reused.values())


def test_a_generation_batch_and_a_chats_next_turn_begin_from_a_held_prefix(reusing):
    client, url = reusing.client, reusing.web.url
    system = {"role": "system", "content": INSTRUCTION}
    rows = [line(f"g{i}", CHAT, {"model": MODEL_ID, "temperature": 0, "max_tokens": 6,
                                 "messages": [system, {"role": "user", "content": text}]}) for i, text in enumerate(TEXTS)]
    done = wait_for(client, start_batch(client, rows, CHAT, extra_body={"batched_decoding": True,
                                                                        "prefix_reuse": True}).id)
    assert done.status == "completed"
    output = read_jsonl(client, done.output_file_id)
    # The first prefill leaves the system prompt's blocks; the rows after it begin from them.
    assert max(row["response"]["millm"]["prefix_tokens_reused"] for row in output) >= 32

    conversation = [system, {"role": "user", "content": "First question, about the weather today?"}]
    first = httpx.post(url + CHAT, json={"model": MODEL_ID, "messages": conversation, "max_tokens": 8,
                                         "temperature": 0}).json()
    conversation += [first["choices"][0]["message"], {"role": "user", "content": "And tomorrow?"}]
    second = httpx.post(url + CHAT, json={"model": MODEL_ID, "messages": conversation, "max_tokens": 8,
                                          "temperature": 0}).json()
    held = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert held >= first["usage"]["prompt_tokens"] - BLOCK_TOKENS - 1 and held % BLOCK_TOKENS == 0
    # A completion generates seated too: the same long prompt a second time begins from the first's.
    completion = {"model": MODEL_ID, "prompt": INSTRUCTION + "Text: it rained.\nLabel:", "max_tokens": 3,
                  "temperature": 0}
    httpx.post(url + COMPLETIONS, json=completion)
    again = httpx.post(url + COMPLETIONS, json=completion).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    metrics = httpx.get(url + "/metrics").text
    assert any(row.startswith("millm_prefix_tokens_reused_total{") and float(row.split()[-1]) >= held
               for row in metrics.splitlines())


@pytest.mark.parametrize("create, says", [
    ({"prefix_reuse": True}, "prefix_reuse needs pack: true"),
    ({"prefix_reuse": "yes", "pack": True}, "prefix_reuse must be true or false"),
])
def test_the_opt_in_is_refused_where_it_cannot_apply(client, create, says):
    uploaded = client.files.create(file=("in.jsonl", b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                                                     b'"body": {"model": "m", "prompt": "x", "max_tokens": 1}}\n'),
                                   purpose="batch")
    answer = httpx.post(str(client.base_url).rstrip("/").removesuffix("/v1") + "/v1/batches",
                        json={"input_file_id": uploaded.id, "endpoint": COMPLETIONS, "completion_window": "24h", **create})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "prefix_reuse" and says in error["message"]


def test_a_probe_batch_refuses_prefix_reuse(client):
    uploaded = client.files.create(file=("in.jsonl", b'{"custom_id": "a", "method": "POST", "url": "/api/probes/score", '
                                                     b'"body": {"probe_ids": ["p"], "inputs": [{"text": "x"}]}}\n'),
                                   purpose="batch")
    answer = httpx.post(str(client.base_url).rstrip("/").removesuffix("/v1") + "/v1/batches",
                        json={"input_file_id": uploaded.id, "endpoint": "/api/probes/score", "completion_window": "24h",
                              "pack": True, "prefix_reuse": True})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "prefix_reuse" and "always run alone" in answer.json()["error"]["message"]


def cache_bytes(url):
    """The engine's millm_prefix_cache_bytes, as /metrics reads it from its last heartbeat."""
    rows = [row for row in httpx.get(url + "/metrics").text.splitlines() if row.startswith("millm_prefix_cache_bytes{")]
    return float(rows[0].split()[-1])


def settled_cache_bytes(url, wanted=None, timeout=15):
    """The gauge once two heartbeats agree (or once it equals `wanted`)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        value = cache_bytes(url)
        if value == wanted or (wanted is None and value == last):
            return value
        last = value
        time.sleep(0.6)
    return cache_bytes(url)


@pytest.mark.parametrize("end", ["cancelled", "expired"])
def test_a_cancelled_or_expired_batch_frees_the_prefixes_it_computed(reusing, end):
    client, url = reusing.client, reusing.web.url
    before = settled_cache_bytes(url)
    # An instruction of its own: a prefix another test's request left in the cache (owned by no
    # batch) would be reused, not computed, and the batch would add nothing to the cache.
    own = {"model": MODEL_ID, "max_tokens": 1, "logprobs": 3}
    rows = [line(f"c{i}", COMPLETIONS, {**own, "prompt": f"A {end} batch. {INSTRUCTION}Text: row {i}.\nLabel:"})
            for i in range(1500)]
    batch = start_batch(client, rows, COMPLETIONS, extra_body={"pack": True, "prefix_reuse": True})
    deadline = time.monotonic() + 60
    while not (client.batches.retrieve(batch.id).request_counts.completed and cache_bytes(url) > before):
        assert time.monotonic() < deadline, "the batch's prefixes never showed in the cache"
        time.sleep(0.1)
    if end == "cancelled":
        client.batches.cancel(batch.id)
    else:
        reusing.sql("UPDATE batches_app_batch SET expires_at = now() WHERE id = %s RETURNING id", [batch.id])
    done = wait_for(client, batch.id)
    assert done.status == end and done.request_counts.completed < len(rows)
    assert settled_cache_bytes(url, wanted=before) == before


def test_a_swap_drops_the_cache_with_the_model(reusing, test_model_dir):
    """The last test here: it swaps the engine's model (to the same weights under another id)."""
    url = reusing.web.url
    conversation = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": "One more question?"}]

    def ask(model):
        return httpx.post(url + CHAT, json={"model": model, "messages": conversation, "max_tokens": 4,
                                            "temperature": 0}, timeout=120).json()

    ask(MODEL_ID)
    assert ask(MODEL_ID)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    registered = httpx.post(url + "/api/models", json={"source": str(test_model_dir), "id": "tiny-again"})
    assert registered.status_code == 201, registered.text
    assert api(reusing, "POST", "/api/models/tiny-again/load").status_code == 202
    wait_resident(reusing, "tiny-again")
    assert settled_cache_bytes(url, wanted=0) == 0
    assert "prompt_tokens_details" not in ask("tiny-again")["usage"]  # nothing held for the new model
