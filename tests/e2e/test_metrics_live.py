"""/metrics around a real batch and real chats (issue 16, point 4): every batch and engine series
the README documents moves as the work does, scraped from the shared stack's web process."""

import threading

import httpx

from tests.e2e.batch_helpers import line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID
from tests.e2e.metrics_helpers import scrape, value
from tests.e2e.stack import wait_until

CHAT = "/v1/chat/completions"
ROWS = 6


def test_batch_series_move_as_a_real_batch_runs(stack, client):
    backlog = {"model": MODEL_ID, "status": "in_progress"}
    rows = {"endpoint": CHAT, "outcome": "succeeded"}
    before = scrape(stack)

    lines = [line(f"m-{i}", CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": f"count {i}"}],
                                   "max_tokens": 40, "temperature": 0}) for i in range(ROWS)]
    batch = start_batch(client, lines, CHAT)
    running = {}

    def seen_running():
        samples = scrape(stack)
        rate = value(samples, "millm_batch_rows_per_second", batch=batch.id, model=MODEL_ID)
        if rate > 0 and value(samples, "millm_batch_rows", endpoint=CHAT, outcome="pending") > 0:
            running.update(samples=samples, rate=rate)
            return True
        return False

    wait_until(seen_running, 120, "the running batch never showed a rate with rows still pending")
    samples = running["samples"]
    assert value(samples, "millm_batches", status="in_progress") >= value(before, "millm_batches", status="in_progress") + 1
    assert value(samples, "millm_batch_backlog_rows", **backlog) > 0

    done = wait_for(client, batch.id, timeout=180)
    assert done.status == "completed"
    generated = sum(row["response"]["body"]["usage"]["completion_tokens"] for row in read_jsonl(client, done.output_file_id))
    prompts = sum(row["response"]["body"]["usage"]["prompt_tokens"] for row in read_jsonl(client, done.output_file_id))
    after = scrape(stack)
    assert value(after, "millm_batches", status="completed") == value(before, "millm_batches", status="completed") + 1
    assert value(after, "millm_batch_rows", **rows) == value(before, "millm_batch_rows", **rows) + ROWS
    assert value(after, "millm_batch_tokens", kind="output") == value(before, "millm_batch_tokens", kind="output") + generated
    assert value(after, "millm_batch_tokens", kind="input") == value(before, "millm_batch_tokens", kind="input") + prompts
    assert ("millm_batch_rows_per_second", frozenset({"batch": batch.id, "model": MODEL_ID}.items())) not in after
    wait_until(lambda: value(scrape(stack), "millm_batch_backlog_rows", **backlog) == 0, 30, "the backlog never emptied")


def test_queue_waits_of_real_chats_are_counted_with_their_seconds(stack):
    engine = {"engine": stack.engine_id(), "model": MODEL_ID}
    before = scrape(stack)
    long_chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 700, "temperature": 0}
    chats = [threading.Thread(target=httpx.post, args=(stack.web.url + CHAT,), kwargs={"json": long_chat, "timeout": 120})
             for _ in range(2)]
    for chat in chats:  # one seat on this stack: the second waits for the first one's whole answer
        chat.start()
    for chat in chats:
        chat.join()

    def counted():
        return (value(scrape(stack), "millm_queue_wait_seconds_count", **engine)
                >= value(before, "millm_queue_wait_seconds_count", **engine) + 2)

    wait_until(counted, 10, "the two chats' waits were not counted")
    after = scrape(stack)
    assert value(after, "millm_queue_wait_seconds_sum", **engine) > value(before, "millm_queue_wait_seconds_sum", **engine) + 0.05
    assert value(after, "millm_queue_estimated_wait_seconds", **engine) >= 0
    assert value(after, "millm_engine_sequences_running", **engine) == 0  # a serial engine decodes no shared sequence
