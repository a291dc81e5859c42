"""Two replicas of one model in one process (SPEC 10c): two real engine Workers, each with its
BatchRunner, run one batch together: one leads it, the other helps, every row is recorded once
by one of them, and the output stays in input order."""

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from batches_app.models import Batch, BatchRow
from inference_app.models import Lease
from tests.batches.inprocess import ENDED, lines_of, scoring
from tests.batches.test_runner_inprocess import running_batch

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("inprocess_settings")]


def run_engines_until(workers, reached, timeout=30):
    """Every worker's batch side (reconcile, then run) at once until `reached()`; then a stop."""

    async def until_reached():
        for worker in workers:
            worker.stopping, worker.nappers = asyncio.Event(), set()
        for worker in workers:
            await sync_to_async(worker.companions[0].reconcile)()
        running = [asyncio.create_task(worker.companions[0].run()) for worker in workers]
        deadline = time.monotonic() + timeout
        try:
            while not await sync_to_async(reached)():
                assert time.monotonic() < deadline, f"not reached within {timeout} s"
                assert not any(task.done() for task in running), [task.result() for task in running if task.done()]
                await asyncio.sleep(0.02)
        finally:
            for worker in workers:
                worker.stopping.set()
            await asyncio.wait_for(asyncio.gather(*running), timeout)
            await sync_to_async(connections.close_all)()

    asyncio.run(until_reached())


def test_two_replicas_share_one_batch_each_row_once_in_input_order(start_engine, settings):
    settings.BATCH_CHUNK_ROWS = 2
    settings.BATCH_TEST_PAUSE_BEFORE_RECORD_S = 0.02  # a chunk takes long enough for the other to claim one
    rows = 40
    batch = running_batch([scoring(f"Row {line}") for line in range(1, rows + 1)])
    first, second = start_engine(), start_engine()
    run_engines_until([first, second], lambda: Batch.objects.get(pk=batch.pk).status in ENDED)
    batch.refresh_from_db()
    assert (batch.status, batch.completed, batch.failed) == (Batch.Status.COMPLETED, rows, 0)
    ran_by = dict(BatchRow.objects.filter(batch=batch).values_list("line", "ran_by"))
    per_engine = {engine: list(ran_by.values()).count(engine) for engine in (first.engine_id, second.engine_id)}
    assert all(count > 0 for count in per_engine.values()), per_engine
    assert sum(per_engine.values()) == rows
    assert [line["custom_id"] for line in lines_of(batch.output_file)] == [f"row-{n}" for n in range(1, rows + 1)]


def test_two_batches_of_one_model_run_oldest_first_and_neither_supersedes_the_others_lease(start_engine, settings):
    settings.BATCH_CHUNK_ROWS = 2
    settings.BATCH_TEST_PAUSE_BEFORE_RECORD_S = 0.02
    older = running_batch([scoring(f"Old {line}") for line in range(1, 21)])
    newer = running_batch([scoring(f"New {line}") for line in range(1, 21)])
    first, second = start_engine(), start_engine()
    run_engines_until([first, second], lambda: Batch.objects.filter(pk__in=[older.pk, newer.pk], status__in=ENDED).count() == 2)
    older.refresh_from_db()
    newer.refresh_from_db()
    assert older.status == newer.status == Batch.Status.COMPLETED
    # One live lease per model: the newer batch waited for the older's, as with one engine; a
    # leader never ended a lease another replica's batch still ran under.
    assert not Lease.objects.filter(end_reason="superseded by another batch").exists()
    assert older.completed_at <= newer.in_progress_at or older.completed_at <= min(
        BatchRow.objects.filter(batch=newer).values_list("recorded_at", flat=True))
