"""The batch runner in-process: a real engine `Worker` driven by the very calls `Worker.serve`
makes, `reconcile()` then `run()`, until the database says the batch got where the test wants;
then stopped as SIGTERM stops it. No subprocess, no mock of the model, the database or the
engine."""

import asyncio
import json
import logging
import time

from asgiref.sync import sync_to_async
from django.db import connections

from batches_app.models import Batch, BatchRow
from batches_app.chunks import PendingRow, execute_rows
from tests.e2e.stack import EXECUTED

ENDED = (Batch.Status.COMPLETED, Batch.Status.FAILED, Batch.Status.EXPIRED, Batch.Status.CANCELLED)
MODEL = "tiny-llama"  # the test model's id (its folder's name)


def generation(prompt, model=MODEL, **fields):
    """A completion that generates (it runs in a chunk of its own), greedily: the tiny random
    model samples any token, U+0000 included, and a test must give the same answer every run."""
    return {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **fields}


def scoring(prompt, model=MODEL):
    """A completion that only scores its prompt: scoring rows share a chunk."""
    return {"model": model, "prompt": prompt, "max_tokens": 1, "logprobs": 0}


def run_engine_until(worker, reached, timeout=15):
    """The engine's batch side from its start (`reconcile()`, then `run()`) until `reached()`, a
    check of the database, is true; then a stop, as the first SIGTERM asks (the chunk in flight
    finishes and its claim is released). Fails on a timeout or an error the runner logged."""
    runner = worker.companions[0]
    errors = _ErrorsOf("millm")

    async def engine_until_reached():
        worker.stopping, worker.nappers = asyncio.Event(), set()  # what `Worker.serve` sets up
        await sync_to_async(runner.reconcile)()
        running = asyncio.create_task(runner.run())
        deadline = time.monotonic() + timeout
        try:
            while not await sync_to_async(reached)():
                assert not errors.records, f"the runner logged an error: {errors.records[0].getMessage()}"
                assert not running.done(), f"the runner stopped by itself: {running.result()!r}"
                assert time.monotonic() < deadline, f"not reached within {timeout} s"
                await asyncio.sleep(0.02)
        finally:
            worker.stopping.set()
            await asyncio.wait_for(running, timeout)
            # The runner's queries ran in asgiref's database thread: close its connection, so the
            # test database can be flushed and dropped.
            await sync_to_async(connections.close_all)()

    with errors:
        asyncio.run(engine_until_reached())
    assert not errors.records, f"the runner logged an error: {errors.records[0].getMessage()}"


def executions(caplog, batch_id):
    """{line: [the engine id of each execution]}, from the runner's `executed` lines (a chunk's,
    logged when it ran, before its record); `caplog` must hear millm.batches.executions at INFO."""
    runs = {}
    for record in caplog.records:
        found = EXECUTED.search(record.getMessage()) if record.name == "millm.batches.executions" else None
        if found and found["batch"] == batch_id:
            for line in found["lines"].split(","):
                runs.setdefault(int(line), []).append(found["engine"])
    return runs




def batch_is(batch_id, status=None, waiting_reason=None):
    """A check for `run_engine_until`: the batch has this status (or any end) or waiting reason."""
    def reached():
        batch = Batch.objects.get(pk=batch_id)
        if waiting_reason is not None:
            return batch.waiting_reason == waiting_reason
        return batch.status == status if status is not None else batch.status in ENDED

    return reached


def run_and_record(batch, runtime, rows, chunk=1):
    """What a runner does with a chunk, without the runner: `rows` run through the service
    functions (`execute_rows`, as in the model thread) and recorded under `batch`'s claim."""
    rows = BatchRow.objects.claim(list(rows), batch.claimed_by)
    results = execute_rows(runtime, batch.endpoint, [PendingRow.of(batch.endpoint, row) for row in rows])
    batch.record_chunk(results, chunk, batch.claimed_by)


def lines_of(file):
    """The JSON lines of a stored file, in file order ([] for no file)."""
    if file is None:
        return []
    with file.open_content() as handle:
        return [json.loads(line) for line in handle]


class _ErrorsOf(logging.Handler):
    """The ERROR records a logger and its children emit while in use, from any thread."""

    def __init__(self, name):
        super().__init__(logging.ERROR)
        self.logger = logging.getLogger(name)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
