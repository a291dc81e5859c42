"""Durability and scheduling: kill mid-chunk, queueing, cancel, expiry, leases, interactive
priority, validation memory. An engine of their own pauses between a chunk's forward pass and
its record (BATCH_TEST_PAUSE_BEFORE_RECORD_S), so tests can act mid-chunk."""

import signal
from pathlib import Path
import threading
import time
from collections import Counter

import httpx
import openai
import pytest

from tests.e2e.batch_helpers import assert_ran_once, line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.stack import Stack, wait_until

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PAUSE = 0.4


@pytest.fixture(scope="module")
def slow(tmp_path_factory, test_model_dir):
    settings = {"BATCH_WAIT_POLL_S": 0.2, "BATCH_TEST_PAUSE_BEFORE_RECORD_S": PAUSE, "BATCH_PROGRESS_MIN_INTERVAL_S": 0}
    with Stack.running(tmp_path_factory.mktemp("slow"), test_model_dir, **settings) as stack:
        stack.client = make_client(stack.web.url)
        yield stack


def scoring_lines(count, prefix="row"):
    return [line(f"{prefix}-{i}", COMPLETIONS, {"model": MODEL_ID, "prompt": f"Item {i}:", "max_tokens": 1, "logprobs": 2})
            for i in range(count)]


def batch_json(stack, batch_id):
    return httpx.get(stack.web.url + f"/v1/batches/{batch_id}").json()


def recorded(stack, batch_id):
    return dict(stack.sql("SELECT line, request_id FROM batches_app_batchrow WHERE batch_id = %s AND outcome <> 'pending' "
                          "AND outcome <> 'invalid'", [batch_id]))


def every_line_once(client, batch, count, prefix="row"):
    output, errors = read_jsonl(client, batch.output_file_id), read_jsonl(client, batch.error_file_id)
    ids = Counter(row["custom_id"] for row in output + errors)
    assert ids == Counter(f"{prefix}-{i}" for i in range(count))
    return output, errors


# First of the module: its follower's long poll stays open in web until the server's next ping
# (up to 25 s after the follower left), and the tests after it outlast that, so the stack stops
# without waiting for it.
def test_socketio_clients_see_every_stage_and_may_follow_one_batch(slow):
    import asyncio

    import socketio

    async def scenario():
        everything, followed = [], []
        watcher, follower = socketio.AsyncClient(), socketio.AsyncClient()
        done = asyncio.Event()

        @watcher.on("batch:progress")
        async def on_all(data):
            everything.append(data)  # filtered by id afterwards: the create's event may come first
            if data["status"] == "completed":
                done.set()

        @follower.on("batch:progress")
        async def on_one(data):
            followed.append(data)

        await watcher.connect(slow.web.url, transports=["websocket"])
        batch = await asyncio.to_thread(start_batch, slow.client, scoring_lines(24, "sio"), COMPLETIONS)
        while not any(state["id"] == batch.id and state["request_counts"]["completed"] >= 8 for state in everything):
            await asyncio.sleep(0.05)
        await follower.connect(slow.web.url, transports=["polling"])
        assert (await follower.call("join", batch.id, timeout=10))["ok"] is True
        await asyncio.wait_for(done.wait(), 60)
        await asyncio.sleep(0.3)
        await watcher.disconnect()
        # A polling client's disconnect waits for its open long poll, which python-engineio
        # answers only at its next ping (25 s): the follower sends its close and leaves at once.
        await follower.eio.disconnect(abort=True)
        return [state for state in everything if state["id"] == batch.id], followed

    everything, followed = asyncio.run(scenario())
    statuses = [state["status"] for state in everything]
    assert statuses[0] == "validating" and statuses[-1] == "completed"
    assert [s for s in ["validating", "in_progress", "finalizing", "completed"] if s in statuses] == [
        "validating", "in_progress", "finalizing", "completed"]
    assert followed[0]["status"] == "in_progress" and followed[0]["request_counts"]["completed"] >= 8  # state first
    assert followed[-1]["status"] == "completed" and {state["id"] for state in followed} == {everything[0]["id"]}


def test_a_kill_mid_chunk_loses_nothing_and_runs_no_recorded_row_again(slow):
    client = slow.client
    batch = start_batch(client, scoring_lines(40), COMPLETIONS)
    wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 8)
    time.sleep(PAUSE / 3)  # inside the next chunk: computed, not yet recorded
    before = recorded(slow, batch.id)
    killed = slow.engine
    killed.popen.send_signal(signal.SIGKILL)
    killed.popen.wait()
    assert 8 <= len(before) < 40

    slow.engine = slow.start_engine()
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (40, 40, 0)
    output, errors = every_line_once(client, done, 40)
    assert errors == []
    by_line = {int(row["custom_id"].split("-")[1]) + 1: row["response"]["request_id"] for row in output}
    assert {line_no: by_line[line_no] for line_no in before} == before  # recorded rows kept their results
    # ... and never executed again: only the chunk in flight at the kill (computed, not recorded) ran twice.
    assert_ran_once(slow, batch.id, range(1, 41), before, killed=[killed])


def test_a_second_batch_waits_queued_then_runs(slow):
    client = slow.client
    first = start_batch(client, scoring_lines(24, "first"), COMPLETIONS)
    second = start_batch(client, scoring_lines(3, "second"), COMPLETIONS)
    wait_until(lambda: batch_json(slow, second.id)["status"] == "in_progress", 30, "the second batch did not validate")
    waiting = batch_json(slow, second.id)
    assert waiting["millm"]["waiting_reason"] == "queued" and batch_json(slow, first.id)["status"] == "in_progress"
    assert waiting["request_counts"]["completed"] == 0

    def backlog():  # both batches' unrun rows, from the database
        return httpx.get(slow.web.url + "/api/health/detailed").json()["inference"]["batch_backlog_rows"]

    wait_until(lambda: backlog() is not None and 3 <= backlog() <= 27, 10, "the backlog does not count both batches' rows")
    done_first, done_second = wait_for(client, first.id), wait_for(client, second.id)
    assert done_first.status == done_second.status == "completed"
    assert done_second.completed_at >= done_first.completed_at


def test_cancel_while_running_keeps_recorded_rows_and_marks_the_rest(slow):
    client = slow.client
    batch = start_batch(client, scoring_lines(32), COMPLETIONS)
    wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 8)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    output, errors = every_line_once(client, done, 32)
    assert len(output) == done.request_counts.completed and 8 <= len(output) < 32
    assert {row["error"]["code"] for row in errors} == {"batch_cancelled"}
    assert done.request_counts.failed == 0  # unrun rows count in neither


def test_cancel_while_validating_ends_cancelled_with_nothing_run(slow):
    client = slow.client
    batch = start_batch(client, scoring_lines(20_000), COMPLETIONS)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling"
    done = wait_for(client, batch.id, timeout=120)
    assert done.status == "cancelled"
    assert done.request_counts.completed == 0 and done.output_file_id is None
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_expiry_keeps_completed_rows_and_marks_unrun_rows_expired(slow):
    client = slow.client
    batch = start_batch(client, scoring_lines(32), COMPLETIONS)
    wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 8)
    slow.sql("UPDATE batches_app_batch SET expires_at = now() WHERE id = %s RETURNING id", [batch.id])
    done = wait_for(client, batch.id)
    assert done.status == "expired" and done.expired_at
    output, errors = every_line_once(client, done, 32)
    assert output and errors and {row["error"]["code"] for row in errors} == {"batch_expired"}
    assert all(row["response"] is None for row in errors)


def lease(stack, holder, ttl=600):
    response = httpx.post(stack.web.url + f"/api/models/{MODEL_ID}/lease", json={"holder": holder, "reason": "test", "ttl_seconds": ttl})
    assert response.status_code == 201, response.text
    return response.json()["data"]["id"]


def release(stack, lease_id):
    httpx.request("DELETE", stack.web.url + f"/api/models/{MODEL_ID}/lease", headers={"X-miLLM-Lease": lease_id})


def current_lease(stack):
    return httpx.get(stack.web.url + f"/api/models/{MODEL_ID}/lease").json()["data"]


def test_a_foreign_lease_refuses_the_create_and_the_callers_lease_runs_it_unreleased(slow):
    client = slow.client
    alice = lease(slow, "alice")
    try:
        with pytest.raises(openai.ConflictError) as caught:
            start_batch(client, scoring_lines(2), COMPLETIONS)
        assert caught.value.code == "model_leased" and "alice" in caught.value.message
        batch = start_batch(client, scoring_lines(9), COMPLETIONS, extra_headers={"X-miLLM-Lease": alice})
        done = wait_for(client, batch.id)
        assert done.status == "completed"
        assert batch_json(slow, batch.id)["millm"]["lease_mode"] == "caller"
        assert current_lease(slow)["holder"] == "alice"  # used, renewed, never released
    finally:
        release(slow, alice)


def test_a_foreign_lease_taken_before_validation_ends_fails_the_batch(slow):
    client = slow.client
    batch = start_batch(client, scoring_lines(20_000), COMPLETIONS)
    bob = lease(slow, "bob")
    try:
        done = wait_for(client, batch.id, timeout=120)
        assert done.status == "failed"
        assert done.errors.data[0].code == "model_leased" and "bob" in done.errors.data[0].message
        assert done.request_counts.completed == 0
    finally:
        release(slow, bob)


def test_a_lease_handed_to_a_waiting_batch_lets_it_run_under_it(slow):
    client = slow.client
    carol = lease(slow, "carol")
    batch = start_batch(client, scoring_lines(40), COMPLETIONS, extra_headers={"X-miLLM-Lease": carol})
    wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 8)
    # Right after a record the runner checks its lease, then spends the pause on the next
    # chunk: end carol's lease and let dave take the model meanwhile.
    release(slow, carol)
    dave = lease(slow, "dave")
    try:
        wait_until(lambda: batch_json(slow, batch.id)["millm"]["waiting_reason"] == "lease_unavailable", 30,
                   "the batch did not wait for the lease")
        stalled = batch_json(slow, batch.id)["request_counts"]["completed"]
        time.sleep(1.0)
        assert batch_json(slow, batch.id)["request_counts"]["completed"] == stalled  # no row ran meanwhile
        handed = httpx.post(slow.web.url + f"/v1/batches/{batch.id}/lease", headers={"X-miLLM-Lease": dave})
        assert handed.status_code == 200 and handed.json()["millm"]["lease_mode"] == "caller"
        done = wait_for(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 40
        assert current_lease(slow)["holder"] == "dave"
        again = httpx.post(slow.web.url + f"/v1/batches/{batch.id}/lease", headers={"X-miLLM-Lease": dave})
        assert again.status_code == 409 and again.json()["error"]["code"] == "batch_state_conflict"
    finally:
        release(slow, dave)


def test_an_interactive_chat_goes_first_at_the_next_chunk_boundary(slow):
    client = slow.client
    rows = [line(f"gen-{i}", CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": "story"}],
                                    "max_tokens": 300, "temperature": 0}) for i in range(6)]
    batch = start_batch(client, rows, CHAT)
    wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 2)
    before = client.batches.retrieve(batch.id).request_counts.completed
    sent = time.time()
    answer = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    answered = time.time()
    assert answer.choices
    progress = client.batches.retrieve(batch.id)
    assert progress.status == "in_progress" and progress.request_counts.completed < 6
    # Went before the batch's next chunk: at most the chunk in flight was recorded meanwhile.
    assert progress.request_counts.completed <= before + 1, (before, progress.request_counts.completed)
    # And waited for that chunk alone: answered at most a moment after the chunk in flight was
    # recorded (its slot is freed before its record, so usually before it). Timed against that
    # chunk's own record, not against the chunk before it: the suite's other worker may load the
    # CPU during one chunk and not the other (a chunk of 2.4 s, then a wait of 6.2 s in CI).
    wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= before + 1)
    times = slow.sql("SELECT recorded_at FROM batches_app_batchrow WHERE batch_id = %s AND recorded_at IS NOT NULL "
                     "ORDER BY recorded_at", [batch.id])
    in_flight_recorded = times[before][0].timestamp()
    assert answered - max(sent, in_flight_recorded) < 2.0, (answered - sent, in_flight_recorded - sent)
    client.batches.cancel(batch.id)
    wait_for(client, batch.id)


def rss_mb(pid):
    for row in open(f"/proc/{pid}/status"):
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    return 0.0


def test_a_50000_line_batch_validates_in_bounded_engine_memory(slow):
    client = slow.client
    httpx.post(slow.web.url + "/api/models", json={"source": str(slow.model_dir), "id": "tiny-absent"})
    rows = [line(f"r{i}", COMPLETIONS, {"model": "tiny-absent", "prompt": f"Line {i} of the file", "max_tokens": 1})
            for i in range(50_000)]
    pid = slow.engine.popen.pid
    baseline = rss_mb(pid)
    peak = [baseline]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        batch = start_batch(client, rows, COMPLETIONS)
        done = wait_for(client, batch.id, timeout=300)
    finally:
        stop.set()
        sampler.join()
    # Every line valid, but the model is not resident: it validated all 50,000 and ran none.
    assert done.status == "failed" and done.errors.data[0].code == "model_not_resident"
    assert done.request_counts.total == 50_000
    growth = peak[0] - baseline
    print(f"engine RSS {baseline:.0f} MB, +{growth:.1f} MB while validating 50,000 lines")
    assert growth < 64


def test_websocket_clients_see_every_stage_in_order_and_late_joiners_the_current_state(slow):
    import asyncio
    import json as jsonlib

    import websockets

    ws_url = slow.web.url.replace("http://", "ws://")

    async def scenario():
        async with websockets.connect(ws_url + "/ws/batches/") as every:
            batch = await asyncio.to_thread(start_batch, slow.client, scoring_lines(24, "ws"), COMPLETIONS)
            seen, late = [], None
            while True:
                event = jsonlib.loads(await asyncio.wait_for(every.recv(), 60))
                if event["data"]["id"] != batch.id:
                    continue
                assert event["event"] == "batch:progress"
                seen.append(event["data"])
                if late is None and event["data"]["request_counts"]["completed"] >= 8:
                    late = await websockets.connect(ws_url + f"/ws/batches/{batch.id}/")
                    first = jsonlib.loads(await asyncio.wait_for(late.recv(), 10))
                    assert first["data"]["id"] == batch.id and first["data"]["status"] == "in_progress"
                    assert first["data"]["request_counts"]["completed"] >= 8  # the current state first
                if event["data"]["status"] in ("completed", "failed", "cancelled", "expired"):
                    break
            await late.close()
            return seen

    seen = asyncio.run(scenario())
    statuses = [state["status"] for state in seen]
    assert statuses[0] == "validating" and statuses[-1] == "completed"
    order = ["validating", "in_progress", "finalizing", "completed"]
    assert [status for status in order if status in statuses] == order
    assert statuses == sorted(statuses, key=order.index)  # never backwards
    progress = [state["request_counts"]["completed"] for state in seen if state["status"] == "in_progress"]
    assert len(progress) >= 3 and progress == sorted(progress)  # chunk progress, one event per chunk
    assert seen[-1]["request_counts"] == {"total": 24, "completed": 24, "failed": 0}


def test_with_keys_set_websocket_and_socketio_refuse_a_client_without_one(slow):
    import asyncio

    import socketio
    import websockets
    from websockets.exceptions import WebSocketException

    web = slow.start_web(MILLM_API_KEYS="sekrit")
    ws_url = web.url.replace("http://", "ws://")

    async def scenario():
        with pytest.raises(WebSocketException):
            async with websockets.connect(ws_url + "/ws/batches/") as refused:
                await asyncio.wait_for(refused.recv(), 5)
        async with websockets.connect(ws_url + "/ws/batches/?token=sekrit") as allowed:
            assert allowed.protocol.state.name == "OPEN"
        client = socketio.AsyncClient()
        with pytest.raises(socketio.exceptions.ConnectionError):
            await client.connect(web.url, transports=["websocket"])
        keyed = socketio.AsyncClient()
        await keyed.connect(web.url, transports=["websocket"], auth={"token": "sekrit"})
        assert keyed.connected
        await keyed.disconnect()

    try:
        asyncio.run(scenario())
    finally:
        web.stop()


CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "var" / "test-artifacts"


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (make test installs it)")
def test_an_operator_watches_a_batch_move_in_the_admin_downloads_its_files_and_cancels_it(slow):
    """With MILLM_API_KEYS set, as in production: the staff session alone carries the page's
    live progress (its WebSocket sends no key), and the file links stream the very bytes the
    API serves, to staff only. Screenshots of the index, the batch list and a running batch's
    page are left in var/test-artifacts/."""
    import subprocess
    import sys

    from playwright.sync_api import sync_playwright

    web = slow.start_web(MILLM_API_KEYS="sekrit")
    client = make_client(web.url, api_key="sekrit")
    env = {**slow.env, "DJANGO_SUPERUSER_PASSWORD": "operator-pass-42"}
    made = subprocess.run([sys.executable, "manage.py", "createsuperuser", "--noinput", "--username", "operator",
                           "--email", "op@example.com"], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True)
    assert made.returncode == 0, f"createsuperuser failed:\n{made.stdout}\n{made.stderr}"
    batch = start_batch(client, scoring_lines(400, "admin"), COMPLETIONS)  # long enough to cancel mid-run
    wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 8)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
        )
        page = browser.new_page(accept_downloads=True, viewport={"width": 1440, "height": 900})
        page.goto(f"{web.url}/admin/login/?next=/admin/")
        page.fill("#id_username", "operator")
        page.fill("#id_password", "operator-pass-42")
        page.click("input[type=submit]")
        page.wait_for_selector("#content-main")
        page.screenshot(path=str(ARTIFACTS / "admin-index.png"), full_page=True)
        page.goto(f"{web.url}/admin/batches_app/batch/")
        page.screenshot(path=str(ARTIFACTS / "admin-batch-list.png"), full_page=True)
        # As an operator goes: from the list, by the admin's own link (it quotes the id: "_40" would be "@").
        page.click(f"#result_list a:text-is('{batch.id}')")
        try:
            page.wait_for_selector("#progress-bar")
        except Exception:  # say where the browser is and what it shows, not only that it timed out
            page.screenshot(path=str(ARTIFACTS / "admin-batch-missing.png"), full_page=True)
            raise AssertionError(f"no progress bar at {page.url}: {page.title()!r}\n{page.inner_text('body')[:1500]}") from None
        start = page.eval_on_selector("#progress-bar", "bar => bar.value")
        page.screenshot(path=str(ARTIFACTS / "admin-batch-running.png"), full_page=True)
        # No reload: the page's WebSocket (keys set, the staff session its only credential) moves the bar.
        page.wait_for_function(f"document.getElementById('progress-bar').value > {start}", timeout=30_000)

        def downloaded(which):
            with page.expect_download() as caught:
                page.click(f"#download-{which}")
            return Path(caught.value.path()).read_bytes()

        assert downloaded("input") == client.files.content(batch.input_file_id).content
        page.click("#cancel-batch")
        page.wait_for_load_state()
        page.wait_for_function("document.getElementById('progress-status').textContent === 'cancelled'", timeout=60_000)
        ended = client.batches.retrieve(batch.id)
        page.reload()
        page.screenshot(path=str(ARTIFACTS / "admin-batch-cancelled.png"), full_page=True)
        output = downloaded("output")
        link = page.get_attribute("#download-output", "href")
        assert output == client.files.content(ended.output_file_id).content and output.count(b"\n") >= 8
        browser.close()
    assert ended.status == "cancelled"
    anonymous = httpx.get(web.url + link, follow_redirects=False)
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous.headers["location"]
    for name in ("admin-index.png", "admin-batch-list.png", "admin-batch-running.png"):
        assert (ARTIFACTS / name).stat().st_size > 10_000
    web.stop()
