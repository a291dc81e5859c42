"""Waiting reasons that match what a batch is doing (issue 26, SPEC 10 "Waiting"): a batch
claimed to run shows none from its claim on (its long first row running included), and a load,
unload or swap makes the waiting batches of the models it changes say `model_not_resident`
from its start until the model is resident again; every change goes out as `batch:progress`."""

import asyncio
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.layers import get_channel_layer
from django.db import connections
from django.utils import timezone

from batches_app import events
from batches_app.models import Batch
from inference_app.engine import residency
from inference_app.models import ModelEntry
from tests.batches.inprocess import MODEL, batch_is, generation, run_engine_until
from tests.factories import BatchFactory, BatchRowFactory, FileFactory, requests_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("inprocess_settings")]

OTHER = "tiny-other"  # a second catalogue entry with the tiny model's weights
NOT_RESIDENT = Batch.Waiting.MODEL_NOT_RESIDENT
LOAD_S = 3.5  # the swap's load: it ends well after the running chunk (2 s) let go of its batch


def waiting_batch(bodies, model=MODEL, reason=Batch.Waiting.QUEUED):
    batch = BatchFactory(input_file=FileFactory(lines=requests_of(bodies)), status=Batch.Status.IN_PROGRESS, model=model,
                         total=len(bodies), in_progress_at=timezone.now(), waiting_reason=reason)
    for line, body in enumerate(bodies, start=1):
        BatchRowFactory(batch=batch, line=line, body=body)
    return batch


class Progress:
    """The `batch:progress` events of some batches, heard on their groups as a client would."""

    def __init__(self, *batches):
        self.layer = get_channel_layer()
        self.channel = async_to_sync(self.layer.new_channel)()
        for batch in batches:
            async_to_sync(self.layer.group_add)(events.batch_group(batch.pk), self.channel)

    def heard(self):
        """{batch id: [waiting_reason of each event, in order]}."""
        async def drain():
            heard = {}
            while True:
                try:
                    message = await asyncio.wait_for(self.layer.receive(self.channel), 0.5)
                except TimeoutError:
                    return heard
                heard.setdefault(message["data"]["id"], []).append(message["data"]["waiting_reason"])

        return async_to_sync(drain)()


def state(batch):
    return Batch.objects.filter(pk=batch.pk).values_list("claimed_by", "waiting_reason", "completed").get()


def test_a_claimed_batch_shows_no_reason_while_its_long_first_row_runs(start_engine, settings):
    settings.BATCH_TEST_PAUSE_BEFORE_RECORD_S = 0.5  # the first row: run, not yet recorded, for half a second
    batch = waiting_batch([generation("One", max_tokens=16), generation("Two")])
    progress = Progress(batch)
    seen = []

    def watched():
        seen.append(state(batch))
        return batch_is(batch.pk)()

    run_engine_until(start_engine(), watched)

    claimed = [(reason, completed) for claimed_by, reason, completed in seen if claimed_by is not None]
    assert [reason for reason, _ in claimed if reason is not None] == []
    assert any(completed == 0 for _, completed in claimed)  # seen claimed before its first record
    assert progress.heard()[batch.pk][0] is None  # the claim's clear was announced


def test_a_swap_makes_its_models_waiting_batches_say_model_not_resident_until_it_ends(start_engine, settings,
                                                                                      monkeypatch, resident):
    settings.BATCH_TEST_PAUSE_BEFORE_RECORD_S = 2.0  # each chunk of `running` holds its rows two seconds
    engine = start_engine()
    ModelEntry.objects.create(id=OTHER, source=ModelEntry.objects.get(pk=MODEL).source, source_format="folder")
    running = waiting_batch([generation(f"Run {line}") for line in range(1, 9)])
    queued = waiting_batch([generation("Queued")])
    other = waiting_batch([generation("Other", model=OTHER)], model=OTHER, reason=NOT_RESIDENT)
    progress = Progress(running, queued, other)

    def slow_load(source):
        time.sleep(LOAD_S)  # a load takes time, longer than a chunk: the batches are looked at meanwhile
        return resident.loaded

    monkeypatch.setattr(residency, "load_model", slow_load)
    during, swap_seconds = asyncio.run(_swap_while_running(engine, running, queued, other))

    # From the swap's start: the queued batch of the model being swapped out, at once (the swap
    # waited for the slot the running chunk held); the running one at its check after that chunk.
    assert during, "nothing was observed during the swap"
    assert all(row["queued"] == (None, NOT_RESIDENT) for row in during)
    assert all(row["other"] == (None, NOT_RESIDENT) for row in during)
    assert all(row["running"][1] in (None, NOT_RESIDENT) and (row["running"][1] is None) == (row["running"][0] is not None)
               for row in during)  # claimed with no reason, or let go with the reason
    assert during[-1]["running"] == (None, NOT_RESIDENT)
    assert swap_seconds >= LOAD_S
    # After it: the batch of the model now resident ran; the others wait, not resident.
    for batch, expected in ((running, NOT_RESIDENT), (queued, NOT_RESIDENT)):
        batch.refresh_from_db()
        assert (batch.status, batch.waiting_reason, batch.claimed_by) == (Batch.Status.IN_PROGRESS, expected, None)
    other.refresh_from_db()
    assert other.status == Batch.Status.COMPLETED
    heard = progress.heard()
    assert NOT_RESIDENT in heard[queued.pk] and NOT_RESIDENT in heard[running.pk]
    # Its model resident again: queued (the sweep), then claimed to run, with no reason from then on.
    cleared = heard[other.pk].index(None)
    assert set(heard[other.pk][:cleared]) <= {Batch.Waiting.QUEUED} and set(heard[other.pk][cleared:]) == {None}


async def _swap_while_running(worker, running, queued, other):
    """The engine's batch side runs `running`; once a row of it is recorded, a swap to OTHER
    begins. Returns each state seen while the swap was under way (from the moment the queued
    batch's reason changed) and the swap's seconds, after `other` completed."""
    runner = worker.companions[0]
    worker.stopping, worker.nappers = asyncio.Event(), set()
    worker.residency.swap_lock = asyncio.Lock()
    read = sync_to_async(lambda: {"running": state(running)[:2], "queued": state(queued)[:2], "other": state(other)[:2]})
    await sync_to_async(runner.reconcile)()
    loop = asyncio.create_task(runner.run())
    try:
        await _until(lambda: state(running)[2] >= 1)
        await asyncio.sleep(0.25)  # inside the next chunk, checked already and running
        started = time.monotonic()
        swap = asyncio.create_task(worker.residency.swap(OTHER))
        # At once: while that chunk still runs (its claim held), not when the runner next looks.
        await _until(lambda: state(queued)[1] == NOT_RESIDENT, timeout=1.0)
        assert (await sync_to_async(state)(running))[0] is not None, "the running chunk ended before the queued batch said why it waits"
        during = []
        while not swap.done():
            during.append(await read())
            await asyncio.sleep(0.02)
        await swap
        seconds = time.monotonic() - started
        await _until(lambda: Batch.objects.get(pk=other.pk).status == Batch.Status.COMPLETED, timeout=15)
        return during[:-1] or during, seconds  # the last read may straddle the swap's end
    finally:
        worker.stopping.set()
        await asyncio.wait_for(loop, 15)
        await sync_to_async(connections.close_all)()


async def _until(check, timeout=15):
    deadline = time.monotonic() + timeout
    while not await sync_to_async(check)():
        assert time.monotonic() < deadline, f"not reached within {timeout} s"
        await asyncio.sleep(0.02)
