"""The courier in-process, against a real receiver: deliveries signed so that the OpenAI SDK
verifies them, retried with growing delays on what may pass (5xx, 429, no answer) and only on
that, bounded in time and in what is read, claimed by one engine at a time, and never sent to a
deleted endpoint or a host no longer allowed."""

import asyncio
import json
import time
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.utils import timezone
from openai import OpenAI

from inference_app.catalogue import model_source
from inference_app.engine.worker import Worker
from webhooks_app import sending
from webhooks_app.courier import WebhookCourier
from webhooks_app.models import Delivery, WebhookEndpoint
from tests.webhooks.receiver import Answer

pytestmark = pytest.mark.django_db(transaction=True)

BATCH_ID = "batch_0123456789abcdef01234567"


@pytest.fixture
def fast(settings):
    settings.MILLM_WEBHOOK_BACKOFF_S = 0.1
    settings.MILLM_WEBHOOK_TIMEOUT_S = 0.5
    settings.MILLM_WEBHOOK_RETRY_HOURS = 1
    return settings


@pytest.fixture
def courier(test_model_dir):
    return WebhookCourier(Worker(model_source(str(test_model_dir))))


def endpoint_at(receiver, path, event_types=("batch.completed",)):
    return WebhookEndpoint.register(name=path, url=receiver.url + path, event_types=list(event_types))


def deliver(courier):
    """One round of the courier: claim what is due, send it, record the answers."""
    async def round_():
        try:
            async with sending.client() as client:
                return await courier.deliver_due(client)
        finally:
            # The claims ran in asgiref's database thread: close its connection, so the test
            # database can be flushed and dropped.
            await sync_to_async(connections.close_all)()
    return asyncio.run(round_())


def deliver_until(courier, delivery, ended, timeout=10):
    deadline = time.monotonic() + timeout
    while not ended(delivery):
        assert time.monotonic() < deadline, f"{delivery.id} is still {delivery.status} after {delivery.attempts} attempts"
        deliver(courier)
        delivery.refresh_from_db()
        time.sleep(0.01)
    return delivery


def enqueue(event_type="batch.completed"):
    return Delivery.objects.enqueue(event_type, {"id": BATCH_ID}, timezone.now())


def unwrap(request, secret):
    return OpenAI(api_key="unused", base_url="http://127.0.0.1:9").webhooks.unwrap(request.body, request.headers, secret=secret)


def test_a_delivery_is_signed_as_the_openai_sdk_verifies_and_sent_once(fast, receiver, courier):
    endpoint = endpoint_at(receiver, "/hook")
    (delivery,) = enqueue()
    assert deliver(courier) == 1
    (request,) = receiver.at("/hook")
    event = unwrap(request, endpoint.secret)
    assert (event.type, event.data.id, event.object) == ("batch.completed", BATCH_ID, "event")
    assert request.headers["webhook-id"] == delivery.id and event.id == delivery.event_id
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code) == ("succeeded", 1, 200)
    assert deliver(courier) == 0 and len(receiver.at("/hook")) == 1
    with pytest.raises(Exception, match="signature"):
        unwrap(request, WebhookEndpoint.register(name="x", url=receiver.url, event_types=["batch.failed"]).secret)


def test_a_failing_receiver_is_retried_with_the_same_id_and_growing_delays(fast, receiver, courier):
    receiver.script("/flaky", Answer(500), Answer(503), Answer(200))
    endpoint_at(receiver, "/flaky")
    (delivery,) = enqueue()
    delivery = deliver_until(courier, delivery, lambda d: d.status != "pending")
    assert (delivery.status, delivery.attempts) == ("succeeded", 3)
    requests = receiver.at("/flaky")
    assert len({request.headers["webhook-id"] for request in requests}) == 1 and len(requests) == 3
    first_gap, second_gap = (later.at - earlier.at for earlier, later in zip(requests, requests[1:]))
    assert 0.1 <= first_gap < second_gap  # 0.1-0.125 s, then 0.2-0.25 s


def test_retry_after_is_honoured_and_other_4xx_and_redirects_end_at_once(fast, receiver, courier):
    receiver.script("/busy", Answer(429, headers={"Retry-After": "3"}))
    receiver.script("/gone", Answer(410))
    receiver.script("/moved", Answer(302, headers={"Location": receiver.url + "/elsewhere"}))
    for path in ("/busy", "/gone", "/moved"):
        endpoint_at(receiver, path)
    enqueue()
    deliver(courier)
    by_path = {delivery.endpoint.url.rsplit("/", 1)[1]: delivery for delivery in Delivery.objects.select_related("endpoint")}
    busy = by_path["busy"]
    assert busy.status == "pending" and busy.last_status_code == 429
    assert 2.9 <= (busy.next_attempt_at - busy.last_attempt_at).total_seconds() <= 3.1
    assert (by_path["gone"].status, by_path["gone"].last_status_code) == ("failed", 410)
    assert (by_path["moved"].status, by_path["moved"].last_status_code) == ("failed", 302)
    assert receiver.at("/elsewhere") == []  # a redirect is not followed


def test_a_receiver_that_never_answers_or_answers_10_mb_costs_a_bounded_attempt(fast, receiver, courier):
    receiver.script("/silent", Answer(200, delay=5))
    receiver.script("/huge", Answer(200, body=b"x" * 10_000_000))
    endpoint_at(receiver, "/silent")
    endpoint_at(receiver, "/huge")
    enqueue()
    started = time.monotonic()
    deliver(courier)
    assert time.monotonic() - started < 2  # the timeout is 0.5 s, whatever the receivers do
    silent = Delivery.objects.get(endpoint__url__endswith="/silent")
    assert silent.status == "pending" and silent.last_status_code is None and "no answer within 0.5 s" in silent.last_error
    huge = Delivery.objects.get(endpoint__url__endswith="/huge")
    assert huge.status == "succeeded" and len(huge.last_answer) == 1024


def test_a_delivery_whose_window_closes_ends_failed_saying_why(fast, receiver, courier):
    fast.MILLM_WEBHOOK_RETRY_HOURS = 0.5 / 3600  # half a second
    endpoint = WebhookEndpoint.register(name="down", url="http://127.0.0.1:9/nobody", event_types=["batch.failed"])
    (delivery,) = enqueue("batch.failed")
    delivery = deliver_until(courier, delivery, lambda d: d.status != "pending")
    assert delivery.status == "failed" and delivery.attempts >= 2
    assert "the retry window (MILLM_WEBHOOK_RETRY_HOURS) closed" in delivery.last_error
    assert endpoint.deliveries.get().pk == delivery.pk


def test_no_subscriber_no_row_and_a_deleted_endpoint_is_never_called(fast, receiver, courier):
    endpoint_at(receiver, "/failed-only", event_types=["batch.failed"])
    assert enqueue("batch.completed") == [] and not Delivery.objects.exists()
    doomed = endpoint_at(receiver, "/doomed")
    enqueue("batch.completed")
    doomed.delete()
    assert deliver(courier) == 0 and receiver.at("/doomed") == [] and not Delivery.objects.exists()


def test_a_host_no_longer_allowed_is_not_called(fast, receiver, courier):
    endpoint_at(receiver, "/hook")
    (delivery,) = enqueue()
    fast.MILLM_WEBHOOK_ALLOWED_HOSTS = ["hooks.example.com"]
    deliver(courier)
    delivery.refresh_from_db()
    assert delivery.status == "failed" and "MILLM_WEBHOOK_ALLOWED_HOSTS" in delivery.last_error
    assert receiver.at("/hook") == []


def test_one_engine_at_a_time_holds_a_delivery_and_a_lapsed_claim_is_taken_again(fast, receiver):
    endpoint_at(receiver, "/hook")
    enqueue()
    (mine,) = Delivery.objects.claim_due("eng_a")
    assert Delivery.objects.claim_due("eng_b") == []  # claimed: not due for another engine
    Delivery.objects.filter(pk=mine.pk).update(claimed_until=timezone.now() - timedelta(seconds=1))  # eng_a died
    (theirs,) = Delivery.objects.claim_due("eng_b")
    assert theirs.pk == mine.pk and theirs.claim_token != mine.claim_token
    answered = sending.Attempt(timezone.now(), status_code=200)
    assert mine.record(answered) is False  # eng_a's late answer is fenced off
    assert theirs.record(answered) is True
    assert Delivery.objects.get().attempts == 1


def test_a_rotated_secret_that_stays_active_signs_beside_the_new_one(fast, receiver, courier):
    endpoint = endpoint_at(receiver, "/hook")
    old = endpoint.secret
    endpoint.rotate_secret(keep_old=True)
    enqueue()
    deliver(courier)
    (request,) = receiver.at("/hook")
    assert len(request.headers["webhook-signature"].split()) == 2
    for secret in (old, endpoint.secret):
        assert json.loads(request.body)["id"] == unwrap(request, secret).id
