"""The validation loop, beside `validation.py` (which validates one batch): it claims
`validating` batches, oldest first, and validates each in a thread of its own, outside the
admission slot, in the engine's event loop beside the run loop."""

import asyncio
import functools
import logging

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection

from batches_app import assembly, events, validation
from batches_app.models import Batch, FencedOut
from batches_app.roles import wake_replicas
from inference_app.engine import rows

log = logging.getLogger("millm.batches")


class ValidationLoop:
    def __init__(self, worker, sweep):
        self.worker = worker
        self.sweep = sweep  # remembers a claim it could not release

    async def run(self):
        worker = self.worker
        while not worker.stopping.is_set():
            try:
                batch = await sync_to_async(self._claim, thread_sensitive=True)()
                if batch is None:
                    await worker.nap(settings.BATCH_WAIT_POLL_S)
                    continue
                runtime = worker.runtime
                await asyncio.to_thread(self._validate_in_thread, batch, runtime)
                worker.wake()  # its rows may run now: the run loop need not finish its nap
                await wake_replicas(batch, worker.engine_id)
            except Exception:
                log.exception("validation failed; retrying")
                await worker.nap(settings.BATCH_WAIT_POLL_S)

    def _claim(self):
        """The oldest batch to validate, claimed with a fresh fencing token; or None (at once,
        with one query, when no batch is unfinished)."""
        if not self.sweep.anything_to_do():
            return None
        return Batch.objects.to_validate().claim_oldest(self.worker.engine_id)

    def _validate_in_thread(self, batch, runtime):
        """`runtime`: the resident model (None when none is), whose tokenizer compiles the rows'
        grammars (once per distinct schema)."""
        try:
            token = batch.claim_token
            check_grammar = functools.partial(rows.check_grammar, runtime) if runtime is not None else None
            outcome = validation.validate(batch, runtime.model_id if runtime is not None else None, check_grammar)
            if outcome == Batch.Status.IN_PROGRESS:
                events.publish(batch)  # the move to in_progress released our claim
                return
            batch.refresh_from_db()
            if batch.claim_token != token:
                raise FencedOut(batch.pk)
            if outcome == Batch.Status.FAILED or batch.status == Batch.Status.CANCELLING:
                assembly.assemble(batch)
            else:
                batch.release_claim()
            events.publish(batch)
        except FencedOut:
            log.warning("batch %s was taken over during validation", batch.pk)
        except Exception:
            log.exception("validating %s failed; it will be validated again", batch.pk)
            self.sweep.release_or_remember(batch)
        finally:
            connection.close()
