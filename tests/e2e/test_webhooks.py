"""Webhooks end to end (issue 17): endpoints registered with the openai SDK against a real
stack, a receiver the test starts (tests/webhooks/receiver.py), and batches run to each of their
four ends. Each delivery verifies with `client.webhooks.unwrap`; retries keep their webhook-id
and back off; a SIGKILL between a batch's end and the first attempt loses nothing; nothing is
written for nobody and nothing is sent to a deleted endpoint; hostile input is a 400 and a
hostile receiver one bounded attempt, while the engine keeps serving.

The retry window is short (MILLM_WEBHOOK_RETRY_HOURS=0.002: 7.2 s) and so are the backoff and
the send timeout, so that a retried or abandoned delivery ends within seconds."""

import base64
import os
import signal
import time
import uuid

import httpx
import openai
import pytest

from tests.e2e.batch_helpers import line, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.faults import COMPLETIONS, scoring_lines
from tests.e2e.stack import Stack, free_port, wait_until
from tests.webhooks.receiver import Answer, Receiver

ENDS = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]
BACKOFF_S = 0.5
TIMEOUT_S = 2
SETTINGS = {
    "BATCH_WAIT_POLL_S": 0.2,
    "MILLM_WEBHOOK_POLL_S": 0.2,
    "MILLM_WEBHOOK_BACKOFF_S": BACKOFF_S,
    "MILLM_WEBHOOK_TIMEOUT_S": TIMEOUT_S,
    "MILLM_WEBHOOK_RETRY_HOURS": 0.002,
}


@pytest.fixture(scope="module")
def hooks(tmp_path_factory, test_model_dir):
    with Receiver() as receiver, Stack.running(tmp_path_factory.mktemp("webhooks"), test_model_dir, **SETTINGS) as stack:
        stack.client = make_client(stack.web.url)
        stack.receiver = receiver
        yield stack


@pytest.fixture(autouse=True)
def no_endpoint_outlives_its_test(hooks):
    """Each test subscribes only what it reads; a later batch is delivered to nobody else."""
    yield
    for endpoint in list(hooks.client.webhooks.list(limit=100)):
        hooks.client.webhooks.delete(endpoint.id)


def new_path():
    return f"/hook/{uuid.uuid4().hex[:10]}"


def register(hooks, path, event_types=("batch.completed",), *answers):
    if answers:
        hooks.receiver.script(path, *answers)
    return hooks.client.webhooks.create(name=f"receiver {path}", url=hooks.receiver.url + path, event_types=list(event_types))


def arrivals(hooks, path, count, timeout=30):
    """The requests `path` received, once there are at least `count`."""
    wait_until(lambda: len(hooks.receiver.at(path)) >= count, timeout,
               f"{path} did not receive {count} request(s)", hooks.engine)
    return hooks.receiver.at(path)


def deliveries(hooks, endpoint_id):
    """GET /v1/webhook_endpoints/{id}/deliveries, newest first (never a 5xx)."""
    answer = httpx.get(f"{hooks.web.url}/v1/webhook_endpoints/{endpoint_id}/deliveries", timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()["data"]


def settled(hooks, endpoint_id, status, timeout=30):
    """The endpoint's deliveries once every one of them is `status`."""
    wait_until(lambda: (found := deliveries(hooks, endpoint_id)) and all(d["status"] == status for d in found),
               timeout, f"the deliveries to {endpoint_id} did not end {status}", hooks.engine)
    return deliveries(hooks, endpoint_id)


def completed_batch(client, rows=3):
    batch = wait_for(client, start_batch(client, scoring_lines(rows, prefix="row"), COMPLETIONS).id, timeout=60)
    assert batch.status == "completed"
    return batch


def rows_for_batch(hooks, batch_id):
    return hooks.sql("SELECT count(*) FROM webhooks_app_delivery WHERE payload::jsonb -> 'data' ->> 'id' = %s",
                     [batch_id])[0][0]


def engine_id_of(hooks, process):
    rows = hooks.sql("SELECT id FROM inference_app_engine WHERE pid = %s", [process.popen.pid])
    return rows[0][0] if rows else None


def is_active(hooks, process):
    """This process's own engine (not a killed one whose heartbeat still looks fresh) is active."""
    own = engine_id_of(hooks, process)
    return any(e["id"] == own and e["alive"] and e["role"] == "active" and e["resident_model"] == hooks.model_id
               for e in hooks.engines(hooks.web))


def wait_until_active(hooks, process):
    wait_until(lambda: is_active(hooks, process), 120, "the engine did not become active", process)


def until(check, timeout, message):
    """wait_until, answering what `check` last returned."""
    seen = []
    wait_until(lambda: seen.append(check()) or seen[-1], timeout, message)
    return seen[-1]


def some_secret():
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def test_each_end_of_a_batch_is_delivered_once_signed_as_the_sdk_verifies(hooks):
    client, receiver = hooks.client, hooks.receiver
    path = new_path()
    endpoint = register(hooks, path, ENDS)
    secret = endpoint.signing_secret
    assert secret.startswith("whsec_") and endpoint.event_types == ENDS
    shown = client.webhooks.retrieve(endpoint.id)
    assert getattr(shown, "signing_secret", None) is None and shown.signing_secret_hint.endswith(secret[-4:])

    completed = start_batch(client, scoring_lines(24, prefix="done"), COMPLETIONS)
    # Queued behind `completed` and past its expiry before any of its rows can run.
    expired = start_batch(client, scoring_lines(3, prefix="late"), COMPLETIONS)
    hooks.sql("UPDATE batches_app_batch SET expires_at = now() WHERE id = %s RETURNING id", [expired.id])
    failed = start_batch(client, [line(f"bad-{i}", "/v1/chat/completions", {"model": MODEL_ID}) for i in range(2)],
                         COMPLETIONS)
    cancelled = start_batch(client, scoring_lines(200, prefix="stop"), COMPLETIONS)
    client.batches.cancel(cancelled.id)
    ended = {batch.id: wait_for(client, batch.id, timeout=60) for batch in (completed, expired, failed, cancelled)}
    assert [ended[batch.id].status for batch in (completed, expired, failed, cancelled)] == [
        "completed", "expired", "failed", "cancelled"]

    received = {}
    for request in arrivals(hooks, path, 4):
        event = client.webhooks.unwrap(request.body, request.headers, secret=secret)
        received[event.data.id] = (event, request)
    assert {batch_id: event.type for batch_id, (event, _) in received.items()} == {
        batch.id: f"batch.{batch.status}" for batch in ended.values()}
    for batch_id, (event, _) in received.items():
        batch = ended[batch_id]
        assert event.object == "event" and event.id.startswith("evt_")
        assert event.created_at == getattr(batch, f"{batch.status}_at")  # stamped with the state change
    assert len({event.id for event, _ in received.values()}) == 4
    assert len({request.headers["webhook-id"] for _, request in received.values()}) == 4
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(request.body, request.headers, secret=some_secret())

    shown = settled(hooks, endpoint.id, "succeeded")
    assert sorted((d["id"], d["event_id"], d["event_type"], d["attempts"], d["last_status_code"]) for d in shown) == sorted(
        (request.headers["webhook-id"], event.id, event.type, 1, 200) for event, request in received.values())
    assert len(receiver.at(path)) == 4  # once each


def test_a_failing_receiver_sees_one_webhook_id_with_growing_gaps_and_a_dead_one_ends_failed(hooks):
    client = hooks.client
    flaky_path = new_path()
    flaky = register(hooks, flaky_path, ["batch.completed"], Answer(500), Answer(500), Answer(200))
    dead = client.webhooks.create(name="nobody listens", url=f"http://127.0.0.1:{free_port()}/hook",
                                  event_types=["batch.completed"])
    batch = completed_batch(client)

    tries = arrivals(hooks, flaky_path, 3)
    [delivery] = settled(hooks, flaky.id, "succeeded")
    assert (delivery["attempts"], delivery["last_status_code"], delivery["next_attempt_at"]) == (3, 200, None)
    assert delivery["delivered_at"] is not None and delivery["last_error"] is None
    assert {request.headers["webhook-id"] for request in tries} == {delivery["id"]}
    assert len({request.body for request in tries}) == 1  # one event, the same bytes each time
    for request in tries:
        event = client.webhooks.unwrap(request.body, request.headers, secret=flaky.signing_secret)
        assert (event.id, event.data.id) == (delivery["event_id"], batch.id)
    first_gap, second_gap = tries[1].at - tries[0].at, tries[2].at - tries[1].at
    assert BACKOFF_S * 0.8 <= first_gap < 3, first_gap
    assert second_gap > first_gap, (first_gap, second_gap)

    [abandoned] = settled(hooks, dead.id, "failed", timeout=30)
    assert abandoned["event_id"] == delivery["event_id"] and abandoned["id"] != delivery["id"]
    assert abandoned["attempts"] >= 2 and abandoned["last_status_code"] is None
    assert "Connect" in abandoned["last_error"] and "retry window" in abandoned["last_error"], abandoned
    assert abandoned["next_attempt_at"] is None and abandoned["delivered_at"] is None
    assert len(hooks.receiver.at(flaky_path)) == 3


def test_an_event_claimed_by_an_engine_killed_before_sending_is_delivered_after_restart(hooks):
    client = hooks.client
    path = new_path()
    hooks.engine.stop()
    pausing = hooks.start_engine(WEBHOOK_TEST_PAUSE_BEFORE_SEND_S=30)
    try:
        wait_until_active(hooks, pausing)
        endpoint = register(hooks, path)
        batch = completed_batch(client)
        claimed = "SELECT id, claimed_by, attempts FROM webhooks_app_delivery WHERE endpoint_id = %s"
        wait_until(lambda: hooks.sql(claimed, [endpoint.id])[0][1] is not None, 20,
                   "the pausing engine did not claim the delivery", pausing)
        [(delivery_id, claimed_by, attempts)] = hooks.sql(claimed, [endpoint.id])
        assert (claimed_by, attempts) == (engine_id_of(hooks, pausing), 0)
        pausing.popen.send_signal(signal.SIGKILL)
        pausing.popen.wait()
        assert hooks.receiver.at(path) == []  # killed after the batch ended, before the first attempt
    finally:
        pausing.kill()
        hooks.engine = hooks.start_engine()
        wait_until_active(hooks, hooks.engine)

    received = arrivals(hooks, path, 1, timeout=60)
    [delivery] = settled(hooks, endpoint.id, "succeeded")
    assert delivery["id"] == delivery_id and delivery["attempts"] == 1
    assert {request.headers["webhook-id"] for request in received} == {delivery_id}
    event = client.webhooks.unwrap(received[0].body, received[0].headers, secret=endpoint.signing_secret)
    assert (event.type, event.data.id) == ("batch.completed", batch.id)


def test_nothing_is_written_for_nobody_and_a_deleted_endpoint_is_never_called(hooks):
    client = hooks.client
    path = new_path()
    failures = register(hooks, path, ["batch.failed"], Answer(500, headers={"Retry-After": "2"}))

    completed = completed_batch(client)
    assert rows_for_batch(hooks, completed.id) == 0  # no endpoint takes batch.completed

    failed = wait_for(client, start_batch(client, [line("bad", "/v1/chat/completions", {"model": MODEL_ID})],
                                          COMPLETIONS).id, timeout=60)
    assert failed.status == "failed" and rows_for_batch(hooks, failed.id) == 1
    arrivals(hooks, path, 1)
    pending = "SELECT status, attempts, claimed_by, extract(epoch FROM next_attempt_at) FROM webhooks_app_delivery " \
              "WHERE endpoint_id = %s"
    wait_until(lambda: hooks.sql(pending, [failures.id])[0][:3] == ("pending", 1, None), 20,
               "the first answer (500, Retry-After: 2) was not recorded", hooks.engine)
    next_attempt_at = float(hooks.sql(pending, [failures.id])[0][3])

    assert client.webhooks.delete(failures.id).deleted
    assert hooks.sql("SELECT count(*) FROM webhooks_app_delivery WHERE endpoint_id = %s", [failures.id]) == [(0,)]
    with pytest.raises(openai.NotFoundError):
        client.webhooks.retrieve(failures.id)
    # Nothing can be polled for here: wait past the retry the endpoint would have had.
    time.sleep(max(0.0, next_attempt_at - time.time()) + 1.5)
    assert len(hooks.receiver.at(path)) == 1


BAD_CREATES = [
    (dict(url="ftp://127.0.0.1/hook"), "url", "ftp"),
    (dict(url="http://user:pw@127.0.0.1/hook"), "url", "credentials"),
    (dict(url="http:///hook"), "url", "no host"),
    (dict(url="http://127.0.0.1/" + "a" * 3000), "url", "2048"),
    (dict(url="http://xn--a.com/hook"), "url", "not a valid URL"),  # IDNA refuses the host: no attempt could send
    (dict(event_types=["response.completed"]), "event_types.0", "response.completed"),
    (dict(name="n" * 300), "name", "300"),
    (dict(extra_body={"secret": "whsec_mine"}), "secret", "secret"),
]


def test_hostile_requests_are_each_a_400_naming_the_field_and_store_nothing(hooks):
    client = hooks.client
    good = register(hooks, new_path())
    stored = "SELECT id, name, url, event_types::text, secret FROM webhooks_app_webhookendpoint ORDER BY id"
    before = hooks.sql(stored)
    assert client.webhooks.event_types.list().data == ENDS

    for change, param, named in BAD_CREATES:
        fields = {"name": "hostile", "url": hooks.receiver.url + "/hostile", "event_types": ["batch.completed"], **change}
        with pytest.raises(openai.BadRequestError) as caught:
            client.webhooks.create(**fields)
        error = caught.value
        assert (error.code, error.param) == ("invalid_webhook_request", param), (change, error.body)
        assert named in error.message, (change, error.message)
    with pytest.raises(openai.BadRequestError) as caught:
        client.webhooks.update(good.id, url="ftp://127.0.0.1/hook", name="renamed")
    assert (caught.value.code, caught.value.param) == ("invalid_webhook_request", "url")
    with pytest.raises(openai.BadRequestError) as caught:
        client.webhooks.test(good.id, event_type="response.completed")
    assert (caught.value.code, caught.value.param) == ("invalid_webhook_request", "event_type")
    with pytest.raises(openai.BadRequestError) as caught:
        client.webhooks.rotate_secret(good.id, extra_body={"keep_old_secret_active_for_24_hours": "yes"})
    assert caught.value.param == "keep_old_secret_active_for_24_hours"
    for body in (b"[]", b'{"name": '):
        answer = httpx.post(f"{hooks.web.url}/v1/webhook_endpoints", content=body,
                            headers={"content-type": "application/json"}, timeout=10)
        assert answer.status_code == 400, (body, answer.text)
    with pytest.raises(openai.NotFoundError) as caught:
        client.webhooks.retrieve("whep_nobody")
    assert caught.value.code == "webhook_endpoint_not_found"

    assert hooks.sql(stored) == before
    assert [endpoint.id for endpoint in client.webhooks.list()] == [good.id]


def test_a_silent_or_huge_receiver_costs_a_bounded_attempt_and_the_engine_keeps_serving(hooks):
    client, receiver = hooks.client, hooks.receiver
    silent_path, huge_path = new_path(), new_path()
    # batch.failed only: the batch run below while the courier waits ends completed, for nobody.
    silent = register(hooks, silent_path, ["batch.failed"], Answer(200, delay=60))
    huge = register(hooks, huge_path, ["batch.failed"], Answer(200, body=b"x" * 10_000_000))
    # Answers that once left a delivery unrecorded, sent again at each lapsed claim past its window.
    far = register(hooks, new_path(), ["batch.failed"], Answer(503, headers={"Retry-After": "1000000000000"}))
    odd = register(hooks, new_path(), ["batch.failed"], Answer(503, headers={"Retry-After": "\u00b2"}))  # "²"
    binary = register(hooks, new_path(), ["batch.failed"], Answer(200, body=b"\x1f\x8b\x08\x00\x00 binary"))

    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        client.webhooks.test(silent.id, event_type="batch.failed")
    assert caught.value.code == "webhook_test_failed" and f"no answer within {TIMEOUT_S} s" in caught.value.message
    assert time.monotonic() - started < TIMEOUT_S + 5
    tested = len(receiver.at(silent_path))

    failed = wait_for(client, start_batch(client, [line("bad", "/v1/chat/completions", {"model": MODEL_ID})],
                                          COMPLETIONS).id, timeout=60)
    assert failed.status == "failed"
    webhook_id = arrivals(hooks, silent_path, tested + 1)[tested].headers["webhook-id"]
    # While the courier waits on the silent receiver, the engine answers a chat and runs a batch.
    chat = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert chat.choices[0].message is not None
    completed_batch(client)

    def attempted():
        found = {d["id"]: d for d in deliveries(hooks, silent.id)}.get(webhook_id)
        return found if found and found["attempts"] >= 1 else None

    recorded = until(attempted, 20, "the silent receiver's attempt was never recorded")
    assert recorded["last_status_code"] is None and f"no answer within {TIMEOUT_S} s" in recorded["last_error"]
    assert recorded["status"] == "pending" and recorded["next_attempt_at"] is not None

    def tries():
        return [request for request in receiver.at(silent_path) if request.headers["webhook-id"] == webhook_id]

    again = until(lambda: len(tries()) >= 2 and tries(), 20, "the silent receiver's delivery was not tried again")
    # The second try follows the first's timeout and one backoff: the courier never hung on it.
    assert TIMEOUT_S <= again[1].at - again[0].at < TIMEOUT_S + BACKOFF_S * 1.25 + 2

    [large] = settled(hooks, huge.id, "succeeded")
    assert (large["attempts"], large["last_status_code"]) == (1, 200)
    [answered] = receiver.at(huge_path)
    assert client.webhooks.unwrap(answered.body, answered.headers, secret=huge.signing_secret).data.id == failed.id
    [too_far] = settled(hooks, far.id, "failed")
    assert (too_far["attempts"], too_far["last_status_code"]) == (1, 503) and "retry window" in too_far["last_error"]
    [retried] = until(lambda: [d for d in deliveries(hooks, odd.id) if d["attempts"] >= 1], 20,
                      "the answer with an unreadable Retry-After was never recorded")
    assert retried["last_status_code"] == 503
    [stored] = settled(hooks, binary.id, "succeeded")
    assert (stored["attempts"], stored["last_status_code"]) == (1, 200)
    assert hooks.engine.alive and is_active(hooks, hooks.engine)


def test_a_test_event_reports_the_receivers_answer_and_a_rotated_secret_overlaps_the_old_one(hooks):
    client, receiver = hooks.client, hooks.receiver
    path = new_path()
    endpoint = register(hooks, path, ["batch.completed"], Answer(202))

    result = client.webhooks.test(endpoint.id, event_type="batch.cancelled")
    assert (result.status_code, result.success, result.event_type, result.webhook_endpoint_id) == (
        202, True, "batch.cancelled", endpoint.id)
    [sample] = receiver.at(path)
    assert client.webhooks.unwrap(sample.body, sample.headers, secret=endpoint.signing_secret).type == "batch.cancelled"

    rotated = client.webhooks.rotate_secret(endpoint.id, keep_old_secret_active_for_24_hours=True)
    assert rotated.signing_secret.startswith("whsec_") and rotated.signing_secret != endpoint.signing_secret
    assert rotated.signing_secret_hint.endswith(rotated.signing_secret[-4:])
    batch = completed_batch(client)
    delivered = arrivals(hooks, path, 2)[1]
    for secret in (endpoint.signing_secret, rotated.signing_secret):
        assert client.webhooks.unwrap(delivered.body, delivered.headers, secret=secret).data.id == batch.id

    fresh = client.webhooks.rotate_secret(endpoint.id)  # no overlap: the earlier secrets stop at once
    assert client.webhooks.test(endpoint.id, event_type="batch.completed").status_code == 202
    latest = arrivals(hooks, path, 3)[2]
    assert client.webhooks.unwrap(latest.body, latest.headers, secret=fresh.signing_secret).type == "batch.completed"
    for stale in (endpoint.signing_secret, rotated.signing_secret):
        with pytest.raises(openai.InvalidWebhookSignatureError):
            client.webhooks.unwrap(latest.body, latest.headers, secret=stale)
