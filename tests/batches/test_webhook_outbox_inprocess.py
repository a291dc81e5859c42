"""A batch's end writes its webhook deliveries in the transaction that ends it (issue 17, point 2):
with a real engine Worker running the batch on the tiny model, the end and its outbox rows come
together or not at all."""

import json

import pytest
from django.db import DatabaseError

from batches_app.models import Batch
from tests.batches.inprocess import batch_is, run_engine_until, scoring
from tests.factories import BatchFactory, FileFactory, requests_of
from webhooks_app.models import Delivery, DeliveryQuerySet, WebhookEndpoint

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("inprocess_settings")]


def subscribe(*event_types):
    return WebhookEndpoint.register(name="pipeline", url="https://hooks.example.com/x", event_types=list(event_types))


def test_a_completed_batch_leaves_one_delivery_per_subscribed_endpoint(start_engine):
    first, second = subscribe("batch.completed"), subscribe("batch.completed", "batch.failed")
    subscribe("batch.cancelled")  # not told
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([scoring("One"), scoring("Two")])))
    run_engine_until(start_engine(), batch_is(batch.id, Batch.Status.COMPLETED))

    deliveries = Delivery.objects.order_by("endpoint_id")
    assert sorted(delivery.endpoint_id for delivery in deliveries) == sorted([first.id, second.id])
    events = [json.loads(delivery.payload) for delivery in deliveries]
    assert {event["id"] for event in events} == {deliveries[0].event_id}  # one event, told twice
    ended_at = int(Batch.objects.get(pk=batch.pk).completed_at.timestamp())
    assert events[0] == {"id": deliveries[0].event_id, "object": "event", "type": "batch.completed",
                         "created_at": ended_at, "data": {"id": batch.id}}
    assert {delivery.status for delivery in deliveries} == {"pending"}


def test_when_the_outbox_write_fails_the_batch_does_not_end_either(start_engine, monkeypatch):
    subscribe("batch.completed")
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([scoring("One")])))

    def broken(self, *args):
        raise DatabaseError("the outbox is unwritable")

    monkeypatch.setattr(DeliveryQuerySet, "enqueue", broken)
    with pytest.raises(AssertionError, match="the batch runner failed"):  # the assembly raised; it is retried
        run_engine_until(start_engine(), batch_is(batch.id, Batch.Status.COMPLETED), timeout=5)
    ended = Batch.objects.get(pk=batch.pk)
    assert ended.status not in Batch.ENDED and ended.output_file is None  # rolled back together
    assert not Delivery.objects.exists()
