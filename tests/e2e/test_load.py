"""Load (SPEC 8): many interactive requests at once while a batch runs, and concurrent uploads and
batch creates. Beyond MAX_PENDING_REQUESTS the engine refuses with 503 queue_full and Retry-After;
every other request is answered; the batch completes; nothing deadlocks."""

import asyncio
import concurrent.futures
import time
from collections import Counter

import httpx
import pytest

from tests.e2e.batch_helpers import read_jsonl, start_batch, to_jsonl, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.faults import COMPLETIONS, scoring_lines
from tests.e2e.stack import Stack, wait_until

LIMIT = 10  # MAX_PENDING_REQUESTS, SPEC 8's default, set explicitly
STORM = 100


@pytest.fixture(scope="module")
def busy(tmp_path_factory, test_model_dir):
    # One seat (the seed's engine): the queue the test counts is MAX_PENDING_REQUESTS itself.
    settings = {"MAX_PENDING_REQUESTS": LIMIT, "BATCH_WAIT_POLL_S": 0.2, "BATCH_TEST_PAUSE_BEFORE_RECORD_S": 0.05,
                "ENGINE_MAX_SEQUENCES": 1}
    with Stack.running(tmp_path_factory.mktemp("load"), test_model_dir, **settings) as stack:
        stack.client = make_client(stack.web.url)
        yield stack


async def storm(url, count):
    """`count` chat requests at once; each (status, body, Retry-After, seconds)."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 32,
            "temperature": 0}
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        gate = asyncio.Event()

        async def one():
            await gate.wait()
            started = time.monotonic()
            response = await http.post("/v1/chat/completions", json=body)
            return response.status_code, response.json(), response.headers.get("Retry-After"), time.monotonic() - started

        tasks = [asyncio.create_task(one()) for _ in range(count)]
        await asyncio.sleep(0.05)
        gate.set()  # all at once
        return await asyncio.gather(*tasks)


def test_100_concurrent_requests_during_a_batch_are_answered_or_refused_queue_full(busy):
    client = busy.client
    batch = start_batch(client, scoring_lines(160), COMPLETIONS)
    wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 8)

    started = time.monotonic()
    outcomes = asyncio.run(storm(busy.web.url, STORM))
    seconds = time.monotonic() - started
    statuses = Counter(status for status, *_ in outcomes)
    print(f"{STORM} concurrent requests, MAX_PENDING_REQUESTS {LIMIT}: {dict(statuses)} in {seconds:.1f} s")
    assert set(statuses) <= {200, 503}, statuses
    assert statuses[200] + statuses[503] == STORM
    assert statuses[503] >= 1, "nothing was refused: the queue never filled"
    assert statuses[200] >= LIMIT  # at least those admitted first
    for status, body, retry_after, _ in outcomes:
        if status == 503:
            assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "server_error", body
            assert f"MAX_PENDING_REQUESTS is {LIMIT}" in body["error"]["message"]
            assert retry_after is not None and retry_after.isdigit() and 1 <= int(retry_after) <= 60, retry_after
        else:
            assert body["object"] == "chat.completion" and body["model"] == MODEL_ID
            choice = body["choices"][0]
            assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
            assert 1 <= body["usage"]["completion_tokens"] <= 32

    # Nothing deadlocked: the queue drains, a request is answered, the batch completes.
    wait_until(lambda: httpx.get(busy.web.url + "/api/health/detailed").json()["inference"]["queue_pending"] == 0, 30,
               "the queue did not drain", busy.engine)
    answer = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.choices
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (160, 0)
    output = read_jsonl(client, done.output_file_id)
    assert [row["custom_id"] for row in output] == [f"row-{i}" for i in range(160)]


def test_20_concurrent_uploads_and_20_concurrent_batch_creates_all_succeed(busy):
    client, url = busy.client, busy.web.url
    contents = [to_jsonl(scoring_lines(3, prefix=f"u{i}")) for i in range(20)]

    def upload(content):
        return httpx.post(url + "/v1/files", data={"purpose": "batch"}, timeout=60,
                          files={"file": ("input.jsonl", content, "application/jsonl")})

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        uploaded = list(pool.map(upload, contents))
    assert [response.status_code for response in uploaded] == [200] * 20, [r.text for r in uploaded if r.status_code != 200]
    file_ids = [response.json()["id"] for response in uploaded]
    assert len(set(file_ids)) == 20
    for file_id, content in zip(file_ids, contents):
        assert client.files.content(file_id).content == content  # each stored whole, none mixed up

    def create(file_id):
        return httpx.post(url + "/v1/batches", timeout=60, json={
            "input_file_id": file_id, "endpoint": COMPLETIONS, "completion_window": "24h"})

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        created = list(pool.map(create, file_ids))
    assert [response.status_code for response in created] == [200] * 20, [r.text for r in created if r.status_code != 200]
    batch_ids = [response.json()["id"] for response in created]
    assert len(set(batch_ids)) == 20
    assert {response.json()["status"] for response in created} <= {"validating", "in_progress"}

    for i, batch_id in enumerate(batch_ids):
        done = wait_for(client, batch_id, timeout=120)
        assert done.status == "completed" and done.input_file_id == file_ids[i]
        assert [row["custom_id"] for row in read_jsonl(client, done.output_file_id)] == [f"u{i}-{n}" for n in range(3)]
