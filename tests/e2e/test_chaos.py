"""Chaos: a batch runs while the engine is SIGKILLed again and again, a web process is SIGKILLed,
and PostgreSQL and Redis restart; afterwards nothing is lost, nothing ran twice, and every
process that was not killed found its way back by itself.

PostgreSQL and Redis are private to the test (tests/e2e/faults.py), so that restarting them
disturbs nothing else. The faults land at random moments while the batch runs (each when the
batch passes a random share of the rows left for it, plus a random part of a chunk), one after
another: each waits until the batch moves again after the previous one (or ends completed, when
a fault lands while it finalizes). The seed is printed; set
CHAOS_SEED to replay a run.

CI runs the short version (300 rows, two engine kills); the full one (2,000 rows, five engine
kills) is marked slow: `make test PYTEST_ARGS="-m slow tests/e2e/test_chaos.py"`.
"""

import os
import random
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.e2e.batch_helpers import assert_ran_once, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.faults import (
    COMPLETIONS, leftover_temporaries, live_leases, orphans, pg_cluster, progress, recorded, redis_server,
    scoring_lines,
)
from tests.e2e.stack import Stack, wait_until

RECOVERY_S = 60


class Traffic(threading.Thread):
    """Interactive requests all along, to every web process in turn: what each got, and when."""

    def __init__(self, webs):
        super().__init__(daemon=True)
        self.webs = webs  # name -> process; the test swaps a killed web for its successor
        self.outcomes = []
        self.stopped = threading.Event()

    def run(self):
        turn = 0
        while not self.stopped.is_set():
            name = sorted(self.webs)[turn % len(self.webs)]
            turn += 1
            web = self.webs[name]
            started = time.monotonic()
            try:
                response = httpx.post(web.url + "/v1/chat/completions", timeout=30, json={
                    "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                body = response.json()
                code = body.get("error", {}).get("code") if response.status_code != 200 else None
                self.outcomes.append((started, name, web.popen.pid, response.status_code, code,
                                      response.headers.get("Retry-After")))
            except (httpx.HTTPError, ValueError) as error:
                self.outcomes.append((started, name, web.popen.pid, type(error).__name__, None, None))
            self.stopped.wait(0.25)


def chat_ok(web):
    try:
        response = httpx.post(web.url + "/v1/chat/completions", timeout=10, json={
            "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        return response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None
    except httpx.HTTPError:
        return False


def completed_now(stack, batch_id):
    try:
        return progress(stack, batch_id)[1]
    except Exception:  # PostgreSQL may be restarting
        return None


def moved_since(stack, batch_id, at):
    """The batch recorded a row after the fault, or ended completed: a fault can land after the
    last row was recorded (while the batch finalizes), and then finishing is the recovery."""
    try:
        status, completed = progress(stack, batch_id)[:2]
    except Exception:  # PostgreSQL may be restarting
        return False
    return completed > at or status == "completed"


def stuck_state(stack, batch_id):
    """What the database says when a batch does not move: for the failure message."""
    try:
        return "\n".join([
            f"batch: {stack.sql('SELECT status, completed, failed, claimed_by, waiting_reason, lease_id, end_status FROM batches_app_batch WHERE id = %s', [batch_id])}",
            f"engines: {stack.sql('SELECT id, role, model_id, resident_model_id, heartbeat_at, now() FROM inference_app_engine')}",
            f"leases: {stack.sql('SELECT holder, model_id, engine_id, ended_at, expires_at FROM inference_app_lease')}",
            f"locks: {stack.sql('SELECT pid, state, wait_event_type, query FROM pg_stat_activity WHERE datname = current_database()')}",
        ])
    except Exception as error:
        return f"(the database could not be read: {error})"


def run_chaos(tmp_path, model_dir, rows, engine_kills, pause):
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    print(f"chaos seed {seed}: {rows} rows, {engine_kills} engine kills, 1 web kill, 1 PostgreSQL and 1 Redis restart")
    started = time.monotonic()
    with pg_cluster() as pg, redis_server(tmp_path) as redis:
        settings = {"BATCH_WAIT_POLL_S": 0.2, "BATCH_TEST_PAUSE_BEFORE_RECORD_S": pause}
        with Stack.running(tmp_path, model_dir, pg_port=pg.port, redis_url=redis.url, **settings) as stack:
            webs = {"a": stack.web, "b": stack.start_web()}
            client = make_client(webs["a"].url)
            batch = start_batch(client, scoring_lines(rows), COMPLETIONS)
            wait_for(client, batch.id, {"in_progress"}, timeout=60)

            faults = ["engine"] * engine_kills + ["web", "postgres", "redis"]
            rng.shuffle(faults)
            traffic = Traffic(webs)
            traffic.start()
            before_faults, timeline, killed_webs, faulted_engines, before_first = {}, [], set(), [], None
            try:
                for turn, fault in enumerate(faults):
                    # Each fault lands a random share into the rows left for it: the batch goes on
                    # running while the test waits out a recovery, and a fault drawn against the
                    # whole file would often land after the last row.
                    now = completed_now(stack, batch.id) or 0
                    room = max(0, int(0.9 * rows) - now) / (len(faults) - turn)
                    threshold = now + int(rng.uniform(0.1, 1.0) * room)
                    wait_until(lambda: (completed_now(stack, batch.id) or 0) >= threshold, RECOVERY_S,
                               f"the batch did not reach {threshold} rows before the {fault} fault", stack.engine)
                    time.sleep(rng.uniform(0, pause + 0.05))  # anywhere in a chunk: mid-forward, mid-pause, mid-record
                    snapshot = recorded(stack, batch.id)
                    before_faults.update(snapshot)
                    before_first = snapshot if before_first is None else before_first
                    at = len(snapshot)
                    status_then = progress(stack, batch.id)[0]
                    fault_started = time.monotonic()
                    engine = stack.engine
                    if fault in ("engine", "postgres"):  # its chunk in flight may run again
                        faulted_engines.append(engine)
                    if fault == "engine":
                        engine.kill()
                        stack.engine = stack.start_engine()
                    elif fault == "web":
                        webs["b"].kill()
                        killed_webs.add(webs["b"].popen.pid)
                        assert chat_ok(webs["a"]), "the other web process stopped answering"
                        webs["b"] = stack.start_web()
                    elif fault == "postgres":
                        pg.restart(down_s=1.0)
                    else:
                        redis.restart(down_s=1.0)
                    # The batch moves again (with the same engine process, unless it was the one killed).
                    try:
                        wait_until(lambda: moved_since(stack, batch.id, at), RECOVERY_S,
                                   f"the batch did not move again after the {fault} fault", stack.engine)
                    except AssertionError as stuck:
                        raise AssertionError(f"{stuck}\n{stuck_state(stack, batch.id)}") from None
                    if fault == "engine":  # and the new engine answers interactive requests
                        wait_until(lambda: chat_ok(webs["a"]), RECOVERY_S, "the new engine does not answer", stack.engine)
                    if fault in ("postgres", "redis"):
                        assert stack.engine is engine and engine.alive, f"the engine died when {fault} restarted"
                        for web in webs.values():
                            wait_until(lambda: chat_ok(web), RECOVERY_S, f"web did not reconnect after the {fault} restart")
                    if fault == "postgres":  # the restart freed the advisory lock; no standby: it took it back
                        wait_until(lambda: "holds the lock of" in engine.log(), 10, "the engine did not retake its lock")
                    seconds = round(time.monotonic() - fault_started, 2)
                    timeline.append((fault, at, seconds))
                    print(f"  {fault:8} at {at:5} recorded rows ({status_then}): the batch moved again after {seconds} s")

                done = wait_for(client, batch.id, timeout=180)
            finally:
                traffic.stopped.set()
                traffic.join(30)

            # Every custom_id exactly once, none failed, and counts equal the files.
            assert done.status == "completed", (done.status, done.errors)
            assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (rows, rows, 0)
            output, errors = read_jsonl(client, done.output_file_id), read_jsonl(client, done.error_file_id)
            assert Counter(row["custom_id"] for row in output + errors) == Counter(f"row-{i}" for i in range(rows))
            assert errors == [] and done.error_file_id is None
            assert [row["custom_id"] for row in output] == [f"row-{i}" for i in range(rows)]  # input order
            files = dict(stack.sql("SELECT id, line_count FROM files_app_file WHERE id = %s", [done.output_file_id]))
            assert files[done.output_file_id] == len(output) == done.request_counts.completed
            assert client.files.retrieve(done.output_file_id).bytes == len(client.files.content(done.output_file_id).content)

            # No recorded row ran again: every row recorded before a fault kept its request id.
            request_ids = {int(row["custom_id"].split("-")[1]) + 1: row["response"]["request_id"] for row in output}
            assert {line: request_ids[line] for line in before_faults} == before_faults
            assert len(set(request_ids.values())) == rows
            twice = assert_ran_once(stack, batch.id, range(1, rows + 1), before_first, killed=faulted_engines)
            print(f"  lines in flight at a fault that ran twice: {twice}")
            assert all(row["response"]["status_code"] == 200 and row["response"]["body"]["choices"] for row in output)

            # No orphaned bytes, no spool left behind, no lease left held.
            assert orphans(stack) == ([], [])
            assert leftover_temporaries(stack) == []
            assert live_leases(stack) == []

            # The surviving processes are back by themselves: one active engine, both webs answer.
            engines = [e for e in stack.engines(webs["a"]) if e["alive"]]
            assert [(e["role"], e["model"]) for e in engines] == [("active", MODEL_ID)], engines
            assert chat_ok(webs["a"]) and chat_ok(webs["b"])

            check_traffic(traffic.outcomes, killed_webs)
    print(f"chaos run: {round(time.monotonic() - started, 1)} s in all; faults: {timeline}")
    return timeline


def check_traffic(outcomes, killed):
    """Interactive requests during the chaos: answered (200) or refused cleanly (503 with an
    integer Retry-After); only the killed web process may drop a connection."""
    statuses = Counter(outcome[3] for outcome in outcomes)
    refusals = Counter(outcome[4] for outcome in outcomes if outcome[3] == 503)
    print(f"  interactive requests during the chaos: {dict(statuses)}; 503s: {dict(refusals)}")
    assert statuses[200] > 0
    for started, name, pid, status, code, retry_after in outcomes:
        if status == 200:
            continue
        if isinstance(status, str):  # no HTTP answer
            assert pid in killed, f"web {name} (not killed) dropped a request: {status}"
            continue
        assert status == 503, (status, code)
        assert retry_after is not None and int(retry_after) >= 1, (status, code, retry_after)


def test_chaos_short_batch_survives_engine_web_postgres_and_redis_faults(tmp_path, test_model_dir):
    timeline = run_chaos(tmp_path, test_model_dir, rows=300, engine_kills=2, pause=0.15)
    assert Counter(fault for fault, _, _ in timeline) == {"engine": 2, "web": 1, "postgres": 1, "redis": 1}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_2000_row_batch_survives_five_engine_kills_and_every_other_fault(tmp_path, test_model_dir):
    timeline = run_chaos(tmp_path, test_model_dir, rows=2000, engine_kills=5, pause=0.1)
    assert Counter(fault for fault, _, _ in timeline) == {"engine": 5, "web": 1, "postgres": 1, "redis": 1}
