"""Several engines on one database (SPEC 5): for one model, one active engine runs every batch and
a standby takes over when it dies, resuming the batch with nothing lost or repeated; engines for
two models each run their own batches; a PostgreSQL restart leaves one active engine per model.

The database is a private PostgreSQL cluster (tests/e2e/faults.py): the last test restarts it.
"""

import os
import re
import signal
import threading
import time
from collections import Counter

import httpx
import openai
import pytest

from tests.e2e.batch_helpers import assert_ran_once, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.faults import COMPLETIONS, live_leases, pg_cluster, progress, recorded, scoring_lines
from tests.e2e.stack import Stack, wait_until

SECOND = "tiny-second"
PAUSE = 0.3
STALE_S = 3.0  # Stack's ENGINE_STALE_S
LOST_LOCK_EXIT = 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory, test_model_dir):
    """An active engine of the tiny model, a standby of it, an engine of a second model (the same
    folder registered under another id) and web; all on a private cluster."""
    work = tmp_path_factory.mktemp("standby")
    with pg_cluster() as pg:
        settings = {"BATCH_WAIT_POLL_S": 0.2, "BATCH_TEST_PAUSE_BEFORE_RECORD_S": PAUSE, "ENGINE_STALE_S": STALE_S}
        with Stack.running(work, test_model_dir, pg_port=pg.port, **settings) as stack:
            stack.pg = pg
            stack.client = make_client(stack.web.url)
            registered = httpx.post(stack.web.url + "/api/models", json={"source": str(test_model_dir), "id": SECOND})
            assert registered.status_code == 201, registered.text
            stack.standby = stack.start_engine()
            stack.second = stack.start_engine(MILLM_MODEL_ID=SECOND)
            wait_until(lambda: roles(stack).count((MODEL_ID, "standby")) == 1, 90,
                       "the second engine did not register as a standby", stack.standby)
            yield stack


def engines(stack):
    return [e for e in httpx.get(stack.web.url + "/api/health/detailed", timeout=5).json()["engines"] if e["alive"]]


def roles(stack):
    return sorted((e["model"], e["role"]) for e in engines(stack))


def engine_of(stack, process):
    """The health entry of an engine process, by its pid."""
    pids = dict(stack.sql("SELECT id, pid FROM inference_app_engine"))
    return next((e for e in engines(stack) if pids.get(e["id"]) == process.popen.pid), None)


class Claims(threading.Thread):
    """Who holds each batch's claim while its rows run (in_progress), sampled from the database
    every 50 ms. (Assembling a finished batch needs no model: any engine may claim that.)"""

    def __init__(self, stack, batch_ids):
        super().__init__(daemon=True)
        self.stack, self.batch_ids = stack, list(batch_ids)
        self.samples = []  # (monotonic time, batch id, claimed_by)
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.is_set():
            try:
                for batch_id, claimed_by in self.stack.sql(
                        "SELECT id, claimed_by FROM batches_app_batch WHERE id = ANY(%s) AND claimed_by IS NOT NULL "
                        "AND status = 'in_progress' AND end_status IS NULL", [self.batch_ids]):
                    self.samples.append((time.monotonic(), batch_id, claimed_by))
            except Exception:
                pass
            self.stopped.wait(0.05)

    def holders(self, batch_id, before=None, after=None):
        return {held for at, batch, held in self.samples if batch == batch_id
                and (before is None or at < before) and (after is None or at >= after)}

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.join(5)


def every_line_once(client, batch, rows, prefix="row"):
    output, errors = read_jsonl(client, batch.output_file_id), read_jsonl(client, batch.error_file_id)
    assert Counter(row["custom_id"] for row in output + errors) == Counter(f"{prefix}-{i}" for i in range(rows))
    assert errors == []
    return output


def test_the_standby_runs_nothing_and_takes_over_a_killed_active_engine_resuming_its_batch(pair):
    client, active, standby = pair.client, pair.engine, pair.standby
    active_id, standby_id = engine_of(pair, active)["id"], engine_of(pair, standby)["id"]
    assert engine_of(pair, standby)["role"] == "standby" and "is a standby" in standby.log()

    batch = start_batch(client, scoring_lines(120), COMPLETIONS)
    with Claims(pair, [batch.id]) as claims:
        wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 24)
        time.sleep(PAUSE / 3)  # inside the next chunk: computed, not yet recorded
        before = recorded(pair, batch.id)
        killed_at = time.monotonic()
        active.kill()
        wait_until(lambda: (engine_of(pair, standby) or {}).get("role") == "active"
                   and engine_of(pair, standby)["resident_model"] == MODEL_ID, 60,
                   "the standby did not take over", standby)
        took_over_s = time.monotonic() - killed_at
        wait_until(lambda: progress(pair, batch.id)[1] > len(before), 60, "the batch did not resume", standby)
        resumed_s = time.monotonic() - killed_at
        # The operator restarts the killed engine: it waits as the standby now.
        pair.engine, pair.standby = standby, pair.start_engine()
        done = wait_for(client, batch.id, timeout=120)
    load_s = float(re.search(rf"loaded {MODEL_ID} in ([0-9.]+) s", standby.log()).group(1))
    print(f"takeover: active {took_over_s:.2f} s after the kill (its load: {load_s:.2f} s; ENGINE_STALE_S {STALE_S}), "
          f"the batch moved again after {resumed_s:.2f} s")
    assert took_over_s <= STALE_S + load_s + 1.0, (took_over_s, load_s)
    assert resumed_s <= STALE_S + load_s + 3.0, (resumed_s, load_s)  # plus reconciliation and one chunk

    # Every batch runs on the active engine only: the standby never held the claim before the kill.
    assert claims.holders(batch.id, before=killed_at) == {active_id}
    assert claims.holders(batch.id, after=killed_at) <= {active_id, standby_id}
    assert standby_id in claims.holders(batch.id, after=killed_at)
    # Nothing lost, nothing repeated.
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (120, 120, 0)
    output = every_line_once(client, done, 120)
    request_ids = {int(row["custom_id"].split("-")[1]) + 1: row["response"]["request_id"] for row in output}
    assert {line: request_ids[line] for line in before} == before
    assert_ran_once(pair, batch.id, range(1, 121), before, killed=[active])  # the standby ran none of them again
    assert live_leases(pair) == []


def test_engines_of_two_models_each_run_their_own_batches_side_by_side(pair):
    client, second = pair.client, pair.second
    wait_until(lambda: (engine_of(pair, second) or {}).get("resident_model") == SECOND, 90,
               f"no active engine for {SECOND}", second)
    ids = {MODEL_ID: engine_of(pair, pair.engine)["id"], SECOND: engine_of(pair, second)["id"]}

    batches = {model: start_batch(client, scoring_lines(48, model=model, prefix=model), COMPLETIONS)
               for model in (MODEL_ID, SECOND)}
    with Claims(pair, [batch.id for batch in batches.values()]) as claims:
        done = {model: wait_for(client, batch.id, timeout=120) for model, batch in batches.items()}
    for model, batch in done.items():
        assert batch.status == "completed" and batch.model == model
        output = every_line_once(client, batch, 48, prefix=model)
        assert {row["response"]["body"]["model"] for row in output} == {model}
        assert {row["response"]["millm"]["headers"]["X-miLLM-Model"] for row in output} == {model}
        assert claims.holders(batches[model].id) == {ids[model]}  # its own engine, and only it
    # Side by side: each ran while the other did (one engine runs one batch at a time).
    first, other = done[MODEL_ID], done[SECOND]
    assert first.in_progress_at <= other.finalizing_at and other.in_progress_at <= first.finalizing_at


def test_an_outside_lease_on_one_model_refuses_only_that_models_batches(pair):
    """Issue 16, point 2, with real engines of two models: alice's lease on the second model
    refuses a batch for it (409 model_leased, nothing stored), while a batch for the first model
    is accepted and completes under its own engine; released, the second model takes batches."""
    client, web = pair.client, pair.web.url
    wait_until(lambda: (engine_of(pair, pair.second) or {}).get("resident_model") == SECOND, 90,
               f"no active engine for {SECOND}", pair.second)
    taken = httpx.post(f"{web}/api/models/{SECOND}/lease", json={"holder": "alice", "reason": "probing", "ttl_seconds": 120})
    assert taken.status_code == 201, taken.text
    lease_id = taken.json()["data"]["id"]
    try:
        batches_before = pair.sql("SELECT count(*) FROM batches_app_batch")[0][0]
        with pytest.raises(openai.ConflictError) as refused:
            start_batch(client, scoring_lines(4, model=SECOND, prefix="leased"), COMPLETIONS)
        assert refused.value.code == "model_leased"
        assert "alice" in refused.value.message and SECOND in refused.value.message
        assert pair.sql("SELECT count(*) FROM batches_app_batch")[0][0] == batches_before

        accepted = start_batch(client, scoring_lines(8, model=MODEL_ID, prefix="free"), COMPLETIONS)
        done = wait_for(client, accepted.id, timeout=120)
        assert done.status == "completed" and done.model == MODEL_ID
        every_line_once(client, done, 8, prefix="free")
    finally:
        released = httpx.request("DELETE", f"{web}/api/models/{SECOND}/lease", headers={"X-miLLM-Lease": lease_id})
    assert released.status_code == 200, released.text
    after = start_batch(client, scoring_lines(4, model=SECOND, prefix="after"), COMPLETIONS)
    assert wait_for(client, after.id, timeout=120).status == "completed"


def test_a_postgresql_restart_leaves_one_active_engine_per_model(pair):
    """The advisory lock lives on a connection the restart cuts, which frees it. Here the standby
    gets it first (the active engine is paused through the restart, SIGSTOP): the former active
    engine, resumed, finds the lock taken and stops with status 3; the standby serves. (The other
    outcome, the active engine taking its lock back, is the chaos test's PostgreSQL restart.)"""
    client = pair.client
    active, standby = pair.engine, pair.standby
    # The killed engine, restarted in the first test, waits as the standby: it took nothing back.
    wait_until(lambda: roles(pair).count((MODEL_ID, "standby")) == 1, 90, "the restarted engine is no standby", standby)
    assert roles(pair).count((MODEL_ID, "active")) == 1 and engine_of(pair, active)["role"] == "active"

    os.kill(active.popen.pid, signal.SIGSTOP)
    try:
        pair.pg.restart(down_s=1.0)
        wait_until(lambda: "is active for" in standby.log(), 30, "the standby did not take the freed lock", standby)
    finally:
        os.kill(active.popen.pid, signal.SIGCONT)
    assert active.popen.wait(30) == LOST_LOCK_EXIT and "lost the lock" in active.log()

    def settled():
        current = roles(pair)
        return current.count((MODEL_ID, "active")) == 1 and current.count((SECOND, "active")) == 1 and all(
            e["resident_model"] for e in engines(pair) if e["role"] == "active")

    wait_until(settled, 60, f"not one active engine per model after the restart: {roles(pair)}", standby)
    assert engine_of(pair, standby)["role"] == "active"
    assert pair.second.alive, f"the engine of {SECOND} died with the restart"
    pair.engine = standby

    batch = start_batch(client, scoring_lines(16), COMPLETIONS)
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "completed" and done.request_counts.completed == 16
    answer = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.choices
