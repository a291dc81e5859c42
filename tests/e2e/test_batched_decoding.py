"""Batched decoding end to end (SPEC 8a): generation rows of a `batched_decoding` batch and
interactive chats share forward passes in the engine's step scheduler, each answer the same as
alone; a kill mid-step loses nothing and runs no recorded row twice."""

import concurrent.futures
import json
import re
import signal
from collections import Counter

import httpx
import jsonschema
import pytest

from tests.e2e.batch_helpers import assert_ran_once, line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID, crowd_of_long_chats, make_client
from tests.e2e.metrics_helpers import scrape, value
from tests.e2e.stack import Stack, wait_until

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
SEATS = 17  # 16 batch rows decode together and one seat stays free for a chat


@pytest.fixture(scope="module")
def seated(tmp_path_factory, test_model_dir):
    settings = {"ENGINE_MAX_SEQUENCES": SEATS, "MAX_PENDING_REQUESTS": 4, "BATCH_WAIT_POLL_S": 0.2,
                "BATCH_PROGRESS_MIN_INTERVAL_S": 0}
    with Stack.running(tmp_path_factory.mktemp("seated"), test_model_dir, **settings) as stack:
        stack.client = make_client(stack.web.url)
        yield stack


def generation_rows(count, max_tokens=24, prefix="gen"):
    return [line(f"{prefix}-{i}", CHAT, {"model": MODEL_ID, "temperature": 0, "max_tokens": max_tokens + i % 5,
                                         "messages": [{"role": "user", "content": f"Tell me about item {i} " * (1 + i % 4)}]})
            for i in range(count)]


def answers(client, batch):
    return {row["custom_id"]: row["response"] for row in read_jsonl(client, batch.output_file_id)}


def test_batched_rows_answer_as_serial_rows_and_say_so(seated):
    client, rows = seated.client, generation_rows(20)
    serial = wait_for(client, start_batch(client, rows, CHAT).id)
    batched = start_batch(client, rows, CHAT, extra_body={"batched_decoding": True})
    assert batched.model_extra["millm"]["batched_decoding"] is True
    batched = wait_for(client, batched.id)
    assert (serial.status, batched.status) == ("completed", "completed")
    assert batched.model_extra["millm"]["batched_decoding"] is True
    alone, together = answers(client, serial), answers(client, batched)
    assert set(alone) == set(together) == {f"gen-{i}" for i in range(20)}
    for custom_id, response in together.items():
        expected = alone[custom_id]
        assert response["body"]["choices"][0]["message"]["content"] == expected["body"]["choices"][0]["message"]["content"]
        assert response["body"]["usage"] == expected["body"]["usage"]
        assert expected["millm"]["batched"] is False and expected["millm"]["headers"]["X-miLLM-Backend"] == "serial"
        backend = response["millm"]["headers"]["X-miLLM-Backend"]
        assert response["millm"]["batched"] is (backend == "batched")
    assert sum(response["millm"]["batched"] for response in together.values()) >= 10  # they shared their steps


def test_batched_rows_with_logprobs_answer_each_tokens_as_serial_rows_do(seated):
    """Issue 46: logprobs on generated tokens through the step scheduler; in float32 a batched
    greedy row's entries are the serial row's (tokens the same, logprobs within 1e-5)."""
    client = seated.client
    rows = [line(f"lp-{i}", CHAT, {"model": MODEL_ID, "temperature": 0, "max_tokens": 10, "logprobs": True,
                                   "top_logprobs": 2, "messages": [{"role": "user", "content": f"Item {i} " * (1 + i)}]})
            for i in range(6)]
    alone = answers(client, wait_for(client, start_batch(client, rows, CHAT).id))
    together = answers(client, wait_for(client, start_batch(client, rows, CHAT, extra_body={"batched_decoding": True}).id))
    assert sum(response["millm"]["batched"] for response in together.values()) >= 3  # they shared steps
    for custom_id, response in together.items():
        mine = response["body"]["choices"][0]["logprobs"]["content"]
        theirs = alone[custom_id]["body"]["choices"][0]["logprobs"]["content"]
        assert len(mine) == response["body"]["usage"]["completion_tokens"] == len(theirs)
        assert [entry["token"] for entry in mine] == [entry["token"] for entry in theirs]
        assert all(abs(a["logprob"] - b["logprob"]) < 1e-5 for a, b in zip(mine, theirs))
        assert all(entry["top_logprobs"][0]["token"] == entry["token"] for entry in mine)


def test_schema_rows_and_a_tool_row_answer_validly_one_at_a_time_and_seated(seated):
    # issue 29: each row keeps its own grammar state; random weights pass only under the grammar.
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer"},
                                               "name": {"type": "string", "maxLength": 8}},
              "required": ["kind", "age", "name"], "additionalProperties": False}
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
               "additionalProperties": False}
    ask = [{"role": "user", "content": "Describe a pet."}]
    rows = [line(f"schema-{seed}", CHAT, {"model": MODEL_ID, "messages": ask, "max_tokens": 80, "temperature": 1.0,
                                          "seed": seed, "response_format": {"type": "json_schema", "json_schema": {
                                              "name": "pet", "schema": schema, "strict": True}}})
            for seed in range(4)]
    rows.append(line("tool", CHAT, {"model": MODEL_ID, "messages": ask, "max_tokens": 60, "seed": 9,
                                    "tools": [{"type": "function", "function": {"name": "weather", "strict": True,
                                                                                "parameters": weather}}],
                                    "tool_choice": "required"}))
    client = seated.client
    for batched in (False, True):
        batch = wait_for(client, start_batch(client, rows, CHAT, extra_body={"batched_decoding": batched}).id)
        assert (batch.status, batch.request_counts.completed) == ("completed", 5), batched
        output = answers(client, batch)
        for seed in range(4):
            jsonschema.validate(json.loads(output[f"schema-{seed}"]["body"]["choices"][0]["message"]["content"]), schema)
        called = output["tool"]["body"]["choices"][0]
        assert called["finish_reason"] == "tool_calls"
        assert called["message"]["tool_calls"][0]["function"]["name"] == "weather"
        jsonschema.validate(json.loads(called["message"]["tool_calls"][0]["function"]["arguments"]), weather)
        assert output["tool"]["millm"]["headers"]["X-miLLM-Grammar"].startswith("tool_call;sha=")


def test_responses_rows_with_a_text_format_answer_seated_as_one_at_a_time(seated):
    # issue 30: a /v1/responses row runs as its chat request, seated under batched decoding too.
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}}, "required": ["word"],
              "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "w", "schema": schema, "strict": True}}
    rows = [line(f"r-{n}", RESPONSES, {"model": MODEL_ID, "input": f"A word for {n}?", "max_output_tokens": 40,
                                       "temperature": 0, "text": text}) for n in range(4)]
    client, texts = seated.client, {}
    for batched in (False, True):
        batch = wait_for(client, start_batch(client, rows, RESPONSES, extra_body={"batched_decoding": batched}).id)
        assert (batch.status, batch.request_counts.completed) == ("completed", 4), batched
        output = answers(client, batch)
        for custom_id, entry in output.items():
            assert entry["body"]["object"] == "response"
            jsonschema.validate(json.loads(entry["body"]["output"][0]["content"][0]["text"]), schema)
            assert entry["millm"]["headers"]["X-miLLM-Grammar"].startswith("json_schema;sha=")
        texts[batched] = {key: entry["body"]["output"][0]["content"][0]["text"] for key, entry in output.items()}
    assert texts[True] == texts[False]  # greedy rows answer alike, seated or alone


def test_a_chat_sent_while_16_rows_decode_streams_before_the_batch_ends(seated):
    client = seated.client
    batch = start_batch(client, generation_rows(48, max_tokens=300), CHAT, extra_body={"batched_decoding": True})
    wait_until(lambda: in_flight(seated) >= 16, 60, "16 batch rows never decoded together", seated.engine)
    engine = {"engine": seated.engine_id(), "model": MODEL_ID}
    wait_until(lambda: value(scrape(seated), "millm_engine_sequences_running", **engine) >= 16, 10,
               "/metrics never showed the 16 sequences decoding")

    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", seated.web.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = (json.loads(row[6:]) for row in response.iter_lines() if row.startswith("data: {"))
        first_content = next(event for event in events if event["choices"] and event["choices"][0]["delta"].get("content"))
        progress = client.batches.retrieve(batch.id)  # read after the first token arrived
        rest = list(events)
    assert first_content["object"] == "chat.completion.chunk"
    # On a CPU (ENGINE_BATCH_ROWS_BESIDE_CHATS auto: pause) the rows pause while the chat decodes.
    assert response.headers["X-miLLM-Backend"] == "serial"
    assert progress.status == "in_progress" and progress.request_counts.completed < 48
    assert rest and rest[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert client.batches.retrieve(batch.id).status == "in_progress"  # the whole chat ended while rows decode
    client.batches.cancel(batch.id)
    assert wait_for(client, batch.id).status == "cancelled"


def in_flight(stack):
    """Seats held, as the engine's heartbeat last reported them."""
    return httpx.get(stack.web.url + "/api/health/detailed", timeout=5).json()["inference"]["in_flight"]


def test_a_seeded_chat_gives_the_same_tokens_alone_and_among_others(seated):
    client = make_client(seated.web.url)
    ask = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Sample me"}], max_tokens=24, temperature=1.2,
               seed=99)
    alone = client.chat.completions.with_raw_response.create(**ask)
    assert alone.headers["X-miLLM-Backend"] == "serial"

    def others(index):
        return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": f"other {index}"}],
                                              max_tokens=400, temperature=0.8)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        crowd = [pool.submit(others, index) for index in range(3)]
        # The others decode already (their 400 tokens last far beyond the seeded chat's 24).
        wait_until(lambda: in_flight(seated) >= 3, 30, "the other chats never took their seats", seated.engine)
        among = pool.submit(lambda: client.chat.completions.with_raw_response.create(**ask))
        [future.result() for future in crowd]
        among = among.result()
    assert among.headers["X-miLLM-Backend"] == "batched"  # it did share its decode steps
    assert among.parse().choices[0].message.content == alone.parse().choices[0].message.content
    assert among.headers["X-miLLM-Seed"] == alone.headers["X-miLLM-Seed"]


def test_max_tokens_and_stop_end_one_sequence_and_not_the_others(seated):
    client = seated.client

    def ask(max_tokens, stop=None):
        return client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "count"}],
                                              max_tokens=max_tokens, temperature=0, stop=stop)

    reference = ask(40).choices[0].message.content
    stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        short, stopped, full = pool.map(lambda args: ask(*args), [(5, None), (40, [stop]), (40, None)])
    assert short.usage.completion_tokens <= 5 and short.choices[0].finish_reason in ("length", "stop")
    assert stopped.choices[0].message.content == reference[: reference.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert full.choices[0].message.content == reference


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "long"}], "max_tokens": 900}),
    ("/v1/responses", {"input": "long", "max_output_tokens": 900}),  # issue 30: its events, on the chat's stream
])
def test_a_client_that_leaves_frees_its_seat(seated, path, body):
    body = {"model": MODEL_ID, "temperature": 0, "stream": True, **body}
    stopped = re.compile(r"stopped streaming: its caller left after (\d+) chunk")
    before = len(stopped.findall(seated.engine.log()))
    with httpx.stream("POST", seated.web.url + path, json=body, timeout=60) as response:
        first = json.loads(next(row for row in response.iter_lines() if row.startswith("data: {")).removeprefix("data: "))
    # The stream was closed after its first chunk: the engine ends the sequence and frees the seat.
    wait_until(lambda: in_flight(seated) == 0, 30, "the seat of a client that left was never freed", seated.engine)
    # ... because the cancel reached the sequence, which stopped early (not at its 900th token).
    wait_until(lambda: len(stopped.findall(seated.engine.log())) == before + 1, 10,
               "the engine never stopped the stream of the client that left", seated.engine)
    assert int(stopped.findall(seated.engine.log())[-1]) < 300
    if path == RESPONSES:  # the README: a response whose client left is not stored
        assert first["type"] == "response.created"
        assert httpx.get(f"{seated.web.url}{RESPONSES}/{first['response']['id']}").status_code == 404


def test_queue_full_with_retry_after_still_holds(tmp_path_factory, test_model_dir):
    """Two seats and MAX_PENDING_REQUESTS 2: two decode, one waits (2 + 2 - 1 = 3), the rest are refused."""
    settings = {"ENGINE_MAX_SEQUENCES": 2, "MAX_PENDING_REQUESTS": 2}
    with Stack.running(tmp_path_factory.mktemp("full"), test_model_dir, **settings) as stack:
        outcomes = crowd_of_long_chats(make_client(stack.web.url), 8, [{"role": "user", "content": "x"}])
    served = [code for code, _ in outcomes if code == "ok"]
    refused = [retry for code, retry in outcomes if code == "queue_full"]
    assert len(served) >= 3 and refused and len(served) + len(refused) == 8, outcomes
    assert all(retry is not None and 1 <= int(retry) <= 60 for retry in refused)


def test_a_kill_mid_step_runs_every_row_exactly_once(seated):
    client, count = seated.client, 40
    batch = start_batch(client, generation_rows(count, max_tokens=120, prefix="kill"), CHAT,
                        extra_body={"batched_decoding": True})
    wait_for(client, batch.id, {"in_progress"}, timeout=60, check=lambda b: b.request_counts.completed >= 4)
    before = dict(seated.sql("SELECT line, request_id FROM batches_app_batchrow WHERE batch_id = %s AND outcome "
                             "<> 'pending'", [batch.id]))
    killed = seated.engine
    killed.popen.send_signal(signal.SIGKILL)  # rows in flight were mid-decode, never recorded
    killed.popen.wait()
    assert 4 <= len(before) < count

    seated.engine = seated.start_engine()
    done = wait_for(client, batch.id, timeout=240)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", count, 0)
    output = read_jsonl(client, done.output_file_id)
    assert Counter(row["custom_id"] for row in output) == Counter(f"kill-{i}" for i in range(count))
    by_line = {int(row["custom_id"].split("-")[1]) + 1: row["response"]["request_id"] for row in output}
    assert {line_no: by_line[line_no] for line_no in before} == before  # recorded rows kept their results
    assert_ran_once(seated, batch.id, range(1, count + 1), before, killed=[killed])  # ... and never ran again
