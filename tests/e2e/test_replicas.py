"""Replicas (SPEC 10c) with real processes: ENGINE_MAX_REPLICAS=3 engines of the tiny model
share one batch (each records part of it) and the chats (each answers some); SIGKILLed at
random moments mid-batch, with a standby taking the freed seat and a restart taking the other,
every custom_id is in the output once and every recorded row keeps its first request id; a
lease binds every replica, and loads, unloads and weights edits are refused while replicated.

The tests run in order on one stack: two replicas, then three, then the kills, then the rules.
"""

import concurrent.futures
import os
import random
import subprocess
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.e2e.batch_helpers import HostPauses, assert_ran_once, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.faults import COMPLETIONS, recorded, scoring_lines
from tests.e2e.stack import Stack, wait_until

SECOND = "tiny-second"
PAUSE = 0.1  # before each chunk's record: a kill lands between a chunk's run and its record
CHUNK = 4  # BATCH_CHUNK_ROWS


def test_host_pauses_sees_this_process_stopped_longer_than_the_stale_limit():
    """The watchdog the kill test reads: a stop of the whole process (as a paused virtual machine
    stops every process) for longer than ENGINE_STALE_S is one pause, and nothing else is. It
    runs before the module's stack starts, so no engine of this module sees the stop."""
    watchdog = HostPauses()
    watchdog.start()
    time.sleep(0.3)
    me, stopped_for = os.getpid(), HostPauses.STALE_S + 0.7
    subprocess.Popen(["sh", "-c", f"kill -STOP {me}; sleep {stopped_for}; kill -CONT {me}"])
    time.sleep(stopped_for + 2.0)  # a sleep that spans the stop, with room for a slow `sh` to start
    watchdog.stopped.set()
    watchdog.join(5)
    assert len(watchdog.pauses) == 1, watchdog.pauses
    (start, end), = watchdog.pauses
    assert HostPauses.STALE_S < end - start < stopped_for + 1.0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, test_model_dir):
    settings = {"ENGINE_MAX_REPLICAS": 3, "BATCH_WAIT_POLL_S": 0.2, "BATCH_CHUNK_ROWS": CHUNK, "ENGINE_MAX_SEQUENCES": 1,
                "BATCH_TEST_PAUSE_BEFORE_RECORD_S": PAUSE}
    with Stack.running(tmp_path_factory.mktemp("replicas"), test_model_dir, **settings) as stack:
        stack.client = make_client(stack.web.url)
        stack.replicas = [stack.engine, stack.start_engine()]
        wait_for_active(stack, 2)
        registered = httpx.post(stack.web.url + "/api/models", json={"source": str(test_model_dir), "id": SECOND})
        assert registered.status_code == 201, registered.text
        yield stack


def active(stack):
    return [e for e in stack.engines(stack.web) if e["alive"] and e["role"] == "active" and e["resident_model"] == MODEL_ID]


def wait_for_active(stack, count, timeout=120):
    wait_until(lambda: len(active(stack)) == count, timeout, f"{count} replicas did not become active")


def rows_per_engine(stack, batch_id):
    return Counter(dict(stack.sql("SELECT ran_by, count(*) FROM batches_app_batchrow WHERE batch_id = %s "
                                  "AND outcome = 'succeeded' GROUP BY ran_by", [batch_id])))


def every_custom_id_once(stack, batch, rows):
    output, errors = read_jsonl(stack.client, batch.output_file_id), read_jsonl(stack.client, batch.error_file_id)
    assert errors == []
    assert [line["custom_id"] for line in output] == [f"row-{i}" for i in range(rows)]  # once each, in input order
    return output


def unrun(stack, batch_id):
    return stack.sql("SELECT count(*) FROM batches_app_batchrow WHERE batch_id = %s AND outcome = 'pending'", [batch_id])[0][0]


def status(stack, batch_id):
    rows = stack.sql("SELECT status FROM batches_app_batch WHERE id = %s", [batch_id])
    return rows[0][0] if rows else None


def chats_granted(stack):
    return dict(stack.sql("SELECT id, queue_waits_total FROM inference_app_engine WHERE role = 'active'"))


def test_two_replicas_each_run_part_of_one_batch_and_chats_spread_over_them(replicas):
    stack, client = replicas, replicas.client
    seats = sorted(e["seat"] for e in active(stack))
    assert seats == [0, 1]
    batch = start_batch(client, scoring_lines(120), COMPLETIONS)
    seen_helper, backlogs = False, []
    while client.batches.retrieve(batch.id).status not in ("completed", "failed"):
        work = [e["batch_work"] for e in active(stack) if e["batch_work"]]
        seen_helper |= {w["role"] for w in work} == {"leader", "helper"} and {w["batch"] for w in work} == {batch.id}
        # The backlog counts each unrun row once, however many replicas run the batch (issue 26).
        # Sampled once the batch runs: while it validates its rows are being written, and a
        # validation committing between the two counts below moved the bound from 0 to 120 rows
        # (a failure seen once).
        validated = status(stack, batch.id) not in ("validating", None)
        unrun_before = unrun(stack, batch.id)
        backlog = httpx.get(stack.web.url + "/api/health/detailed", timeout=5).json()["inference"]["batch_backlog_rows"]
        if validated:
            backlogs.append((unrun(stack, batch.id) - CHUNK, backlog, unrun_before + CHUNK))
        time.sleep(0.05)
    assert [sample for sample in backlogs if not sample[0] <= sample[1] <= sample[2]] == []
    assert any(backlog > 0 for _, backlog, _ in backlogs)
    done = wait_for(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 120
    per_engine = rows_per_engine(stack, batch.id)
    assert len(per_engine) == 2 and min(per_engine.values()) > 0, per_engine
    assert seen_helper, "health never showed one replica leading the batch and the other helping"
    every_custom_id_once(stack, done, 120)

    before = chats_granted(stack)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": f"Hello {i}"}], max_tokens=48, temperature=0),
            range(8)))
    assert all(answer.choices[0].message.content is not None for answer in answers)
    time.sleep(1.5)  # the next heartbeats carry the counts
    after = chats_granted(stack)
    answered = {engine: after[engine] - before.get(engine, 0) for engine in after}
    assert sum(answered.values()) == 8 and all(count > 0 for count in answered.values()), answered


def test_prefix_reuse_on_two_replicas_each_engine_from_its_own_cache(replicas):
    """Issue 45: each engine holds its own prefixes; rows run on either engine reuse the shared
    instruction and answer as the synchronous request does (no wrong reuse across engines)."""
    stack, client = replicas, replicas.client
    instruction = "Label the text as positive or negative, weighing every word and the tone of it. " * 3
    lines = scoring_lines(48)
    for index, row in enumerate(lines):
        row["body"]["prompt"] = f"{instruction}Text: item {index} is here.\nLabel:"
    batch = start_batch(client, lines, COMPLETIONS, extra_body={"pack": True, "prefix_reuse": True})
    done = wait_for(client, batch.id, timeout=180)
    assert done.status == "completed" and done.request_counts.completed == 48
    per_engine = rows_per_engine(stack, batch.id)
    assert len(per_engine) == 2 and min(per_engine.values()) > 0, per_engine
    output = every_custom_id_once(stack, done, 48)
    assert all(row["response"]["millm"]["prefix_tokens_reused"] >= 32 for row in output)
    for row in output[::7]:
        index = int(row["custom_id"].rpartition("-")[2])
        sync = httpx.post(stack.web.url + COMPLETIONS, json=lines[index]["body"]).json()["choices"][0]["logprobs"]
        mine = row["response"]["body"]["choices"][0]["logprobs"]
        assert mine["tokens"] == sync["tokens"]
        assert abs(mine["token_logprobs"][0] - sync["token_logprobs"][0]) < 1e-4
    time.sleep(1.5)  # the next heartbeats carry the counts
    reused = dict(stack.sql("SELECT id, prefix_tokens_reused_total FROM inference_app_engine WHERE role = 'active'"))
    assert len(reused) == 2 and all(tokens > 0 for tokens in reused.values()), reused


def test_three_replicas_each_run_part_of_one_batch(replicas):
    stack = replicas
    stack.replicas.append(stack.start_engine())
    wait_for_active(stack, 3)
    assert sorted(e["seat"] for e in active(stack)) == [0, 1, 2]
    batch = start_batch(stack.client, scoring_lines(120), COMPLETIONS)
    done = wait_for(stack.client, batch.id, timeout=180)
    assert done.status == "completed"
    per_engine = rows_per_engine(stack, batch.id)
    assert len(per_engine) == 3 and min(per_engine.values()) > 0, per_engine
    every_custom_id_once(stack, done, 120)


class Chatter(threading.Thread):
    """Chats one after another until stopped: each answer's status and error code."""

    def __init__(self, stack):
        super().__init__(daemon=True)
        self.client = httpx.Client(base_url=stack.web.url, timeout=60)
        self.outcomes = []  # (monotonic time sent, status, code)
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.is_set():
            sent = time.monotonic()
            answer = self.client.post("/v1/chat/completions", json={
                "model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
            code = None if answer.status_code == 200 else answer.json()["error"]["code"]
            self.outcomes.append((sent, answer.status_code, code))


class FirstRequestIds(threading.Thread):
    """Every row's request id the first time it is seen recorded, sampled from the database."""

    def __init__(self, stack, batch_id):
        super().__init__(daemon=True)
        self.stack, self.batch_id = stack, batch_id
        self.first = {}
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.is_set():
            for line, request_id in recorded(self.stack, self.batch_id).items():
                self.first.setdefault(line, request_id)
            self.stopped.wait(0.05)


def test_replicas_killed_at_random_moments_leave_every_row_once_with_its_first_request_id(replicas):
    stack, client = replicas, replicas.client
    standby = stack.start_engine()
    wait_until(lambda: any(e["alive"] and e["role"] == "standby" for e in stack.engines(stack.web)), 90,
               "the fourth engine did not wait as a standby", standby)
    rows, seed = 600, random.randrange(1_000_000)
    chosen = random.Random(seed)
    first_kill, second_kill = sorted(chosen.uniform(0.1, 0.6) for _ in range(2))
    batch = start_batch(client, scoring_lines(rows), COMPLETIONS)
    ids, chats, pauses = FirstRequestIds(stack, batch.id), Chatter(stack), HostPauses()
    ids.start()
    chats.start()
    pauses.start()
    try:
        killed, recorded_before = [], None
        for share in (first_kill, second_kill):
            wait_for(client, batch.id, {"in_progress"}, timeout=180,
                     check=lambda b, share=share: b.request_counts.completed >= share * rows)
            victim = next(p for p in stack.replicas if p.alive)
            if recorded_before is None:
                recorded_before = recorded(stack, batch.id)  # before the first kill
            victim.kill()
            killed.append(victim)
            if len(killed) == 1:
                # The standby takes the seat the killed replica held.
                wait_until(lambda: len(active(stack)) == 3 and standby.popen.pid in active_pids(stack), 60,
                           f"the standby did not take the freed seat (seed {seed})", standby)
        stack.replicas.append(standby)
        stack.replicas.append(stack.start_engine())  # the restart: it takes the second freed seat
        done = wait_for(client, batch.id, timeout=300)
        after_kills = time.monotonic()
        wait_until(lambda: sum(1 for sent, *_ in chats.outcomes if sent > after_kills) >= 3, 60, "no chat after the kills")
    finally:
        ids.stopped.set()
        chats.stopped.set()
        pauses.stopped.set()
        ids.join(5)
        chats.join(60)
    assert done.status == "completed", f"seed {seed}"
    # A chat in flight on a killed replica answers 503 engine_unavailable; every other chat, and
    # every chat after the kills, is answered by the replicas left.
    assert {(status, code) for _, status, code in chats.outcomes} <= {(200, None), (503, "engine_unavailable")}
    assert all(status == 200 for sent, status, _ in chats.outcomes if sent > after_kills)
    assert sum(1 for _, status, _ in chats.outcomes if status == 200) > 10
    output = every_custom_id_once(stack, done, rows)
    final = dict(stack.sql("SELECT line, request_id FROM batches_app_batchrow WHERE batch_id = %s", [batch.id]))
    changed = {line: (ids.first[line], final[line]) for line in ids.first if ids.first[line] != final[line]}
    assert changed == {}, f"recorded rows ran again (seed {seed})"
    assert_ran_once(stack, batch.id, range(1, rows + 1), recorded_before, killed=killed, pauses=pauses.pauses)
    by_custom_id = {line["custom_id"]: line["response"]["request_id"] for line in output}
    assert by_custom_id[f"row-{rows - 1}"] == final[rows]
    assert len(ids.first) > rows // 2
    wait_for_active(stack, 3)


def active_pids(stack):
    pids = dict(stack.sql("SELECT id, pid FROM inference_app_engine"))
    return {pids.get(e["id"]) for e in active(stack)}


def test_a_lease_binds_every_replica_and_loads_and_weights_are_refused_while_replicated(replicas):
    stack = replicas
    api = httpx.Client(base_url=stack.web.url, timeout=30)
    taken = api.post(f"/api/models/{MODEL_ID}/lease", json={"holder": "alice", "reason": "probing", "ttl_seconds": 600})
    assert taken.status_code == 201, taken.text
    lease = taken.json()["data"]["id"]
    try:
        for _ in range(4):  # whichever replica web reaches
            again = api.post(f"/api/models/{MODEL_ID}/lease", json={"holder": "bob", "reason": "also", "ttl_seconds": 60})
            assert again.status_code == 409 and again.json()["error"]["code"] == "MODEL_LEASED"
        refused = {
            "load": api.post(f"/api/models/{SECOND}/load", json={"engine": active(stack)[0]["id"]},
                             headers={"X-miLLM-Lease": lease}),
            "unload": api.post(f"/api/models/{MODEL_ID}/unload", headers={"X-miLLM-Lease": lease}),
            "weights begin": api.post(f"/api/models/{MODEL_ID}/weights/begin", headers={"X-miLLM-Lease": lease}),
            "save": api.post(f"/api/models/{MODEL_ID}/save", headers={"X-miLLM-Lease": lease}),
        }
        for action, answer in refused.items():
            assert answer.status_code == 409, (action, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "MODEL_REPLICATED" and "3 replicas" in error["message"], (action, error)
        chat = api.post("/v1/chat/completions", json={"model": SECOND, "messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 2})
        # Auto-load: web sends no replica a swap (several engines, none of them for that model).
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "model_not_loaded", chat.text
        assert all(e["resident_model"] == MODEL_ID for e in active(stack))
        # One replica stops: the model is still served, and its lease still binds the others.
        stack.replicas[-1].stop()
        wait_for_active(stack, 2)
        status = api.get(f"/api/models/{MODEL_ID}/lease").json()["data"]
        assert status is not None and status["holder"] == "alice"
        two = api.post(f"/api/models/{MODEL_ID}/weights/begin", headers={"X-miLLM-Lease": lease})
        assert two.status_code == 409 and "2 replicas" in two.json()["error"]["message"], two.text
        assert api.post(f"/api/models/{MODEL_ID}/lease/renew", headers={"X-miLLM-Lease": lease}).status_code == 200
    finally:
        api.request("DELETE", f"/api/models/{MODEL_ID}/lease", headers={"X-miLLM-Lease": lease})
