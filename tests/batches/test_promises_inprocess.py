"""Promises of SPEC 10 that nothing tested (issue 16, point 6), in-process on the tiny model: the
files' expiry follows `output_expires_after`, a running batch holds and renews its own lease,
and a waiting reason the periodic sweep changes is announced like any other change."""

import asyncio
from datetime import timedelta

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.db import connections
from django.db.models import F

from batches_app import events
from batches_app.models import Batch
from inference_app.models import Lease
from tests.batches.inprocess import batch_is, generation, run_engine_until
from tests.factories import BatchFactory, FileFactory, requests_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("inprocess_settings")]


def close_to(moment, expected, slack_s=60):
    return abs((moment - expected).total_seconds()) < slack_s


@pytest.mark.parametrize("output_expires_after, days", [(7_200, None), (None, 30)])
def test_the_output_and_error_files_expire_as_the_batch_asked(start_engine, output_expires_after, days):
    lines = requests_of([generation("One"), generation("Two", max_tokens=5000)])  # one fails: an error file
    batch = BatchFactory(input_file=FileFactory(lines=lines), output_expires_after=output_expires_after)

    run_engine_until(start_engine(), batch_is(batch.pk))

    batch = Batch.objects.get(pk=batch.pk)
    lifetime = timedelta(seconds=output_expires_after) if output_expires_after else timedelta(days=days)
    for file in (batch.output_file, batch.error_file):
        assert close_to(file.expires_at, file.created_at + lifetime), (file.purpose, file.expires_at)


def test_a_running_batch_holds_its_own_lease_and_renews_it(start_engine, settings):
    settings.BATCH_LEASE_TTL_S = 1  # renewed after a third of it
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([generation(f"Row {n}", max_tokens=24) for n in range(60)])))
    holder = f"millm-batch:{batch.pk}"

    def renewed():
        return Lease.objects.filter(holder=holder, renewed_at__gt=F("acquired_at")).exists()

    run_engine_until(start_engine(), renewed, timeout=30)

    # The batch's current lease: the runner renews before each chunk, so a chunk longer than the
    # 1 s TTL (a slow or busy CPU) lets one lapse and the next chunk takes another under the same
    # holder; `get(holder=...)` then found two (seen once on a 2-core AVX2 EPYC).
    batch.refresh_from_db()
    lease = Lease.objects.get(pk=batch.lease_id)
    assert lease.holder == holder and lease.reason == f"batch {batch.pk}"
    assert batch.lease_mode == "own"


def test_a_waiting_reason_the_sweep_changes_is_announced(start_engine):
    worker = start_engine()
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([generation("One", model="absent-model")])),
                         status=Batch.Status.IN_PROGRESS, model="absent-model", total=1, waiting_reason=None)

    async def heard():
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(events.batch_group(batch.pk), channel)
        await sync_to_async(worker.companions[0]._sweep)()
        message = await asyncio.wait_for(layer.receive(channel), 5)
        await sync_to_async(connections.close_all)()
        return message

    message = asyncio.run(heard())
    assert Batch.objects.get(pk=batch.pk).waiting_reason == Batch.Waiting.MODEL_NOT_RESIDENT
    assert message["event"] == events.EVENT
    assert message["data"]["id"] == batch.pk and message["data"]["waiting_reason"] == "model_not_resident"
