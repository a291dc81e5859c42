"""The two roles an engine runs a batch in (SPEC 10c): its `Leader` (the engine that claimed it)
and a `Helper` (another replica of the batch's model, running chunks of the same batch).

The checks before each chunk, the waiting reasons, finalization and assembly are the leader's
alone; a helper claims chunks and records them while the batch runs and no end was asked for
(`Batch.record_chunk` fences each by the role). `claim_to_run` says which role an engine takes.
"""

import logging

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections, transaction

from batches_app import events, leasing
from batches_app.models import Batch, FencedOut
from inference_app.models import Engine

log = logging.getLogger("millm.batches")


class Leader:
    name = "leader"
    leading = True

    def __init__(self, worker):
        self.worker = worker

    def check(self, batch):
        """Before each chunk, in a transaction: "assemble" (an end was asked for: ended here),
        "run" (the batch shows no waiting reason), or "release"/"wait" with the reason recorded
        and the claim released in the same transaction (announced once it commits)."""
        if batch.claim_token is None or batch.claimed_by != self.worker.engine_id:
            raise FencedOut(batch.pk)
        end = batch.due_end()
        if end is not None:
            batch.mark_ending(end)
            return "assemble"
        verdict, reason = self._verdict(batch)
        changed = batch.set_waiting(reason)
        if verdict != "run":
            batch.release_claim()
        if changed:
            transaction.on_commit(lambda: events.publish(batch))
        return verdict

    def _verdict(self, batch):
        worker = self.worker
        runtime = worker.runtime
        if runtime is None or runtime.model_id != batch.model:
            return "release", Batch.Waiting.MODEL_NOT_RESIDENT
        if worker.swapping:
            # Being loaded or unloaded (the seed's `model_not_resident` too): wait for the swap's
            # end (it wakes the runner) rather than claim the batch again at once.
            return "wait", Batch.Waiting.MODEL_NOT_RESIDENT
        if worker.weights_torn:
            # An edit is mid-write: no row runs until a commit or a load (SPEC 10, "Waiting").
            return "wait", Batch.Waiting.WEIGHTS_TORN
        if not leasing.hold(batch, worker.engine_id, settings.BATCH_LEASE_TTL_S):
            return "wait", Batch.Waiting.LEASE_UNAVAILABLE
        return "run", None

    def check_in_transaction(self, batch):
        with transaction.atomic():
            return self.check(batch)

    def when_no_rows_left(self, left):
        """No claimable row: "finalize" once every row is recorded; "wait" while helpers run the
        last ones (their chunks land soon)."""
        return "wait" if left == "claimed" else "finalize"


class Helper:
    name = "helper"
    leading = False

    def __init__(self, worker):
        self.worker = worker

    def check(self, batch):
        """Before each chunk: the leader still holds the batch ("release" when it let go: the
        batch is ours to lead at the next claim), the batch runs and no end was asked for, our
        resident model is its model with clean weights, and the lease the leader runs it under is
        live ("wait" otherwise: the leader records why)."""
        if batch.claimed_by is None:
            return "release"
        worker = self.worker
        runtime = worker.runtime
        if (batch.status != Batch.Status.IN_PROGRESS or batch.end_status or batch.due_end() is not None
                or runtime is None or runtime.model_id != batch.model or worker.swapping
                or worker.weights_torn or not leasing.is_held(batch)):
            return "wait"
        return "run"

    check_in_transaction = check

    def when_no_rows_left(self, left):
        return "done"  # what is left is being run by the others


def claim_to_run(worker):
    """(batch, role, verdict): the oldest batch to end, or to run on the resident model. One that
    no engine holds is claimed with a fresh fencing token and led, unless a batch as old or older
    is led by another replica: then that one is helped while it has rows nobody runs (every
    replica works on the oldest batch first; the policy's `claimable_beside`). (None, None, None)
    when there is nothing.

    A batch to run is checked in the claim's transaction (`verdict`, as the leader's check): it is
    seen unclaimed with the reason it waits for, or claimed to run with none, never between (SPEC
    10, "Waiting")."""
    close_old_connections()
    engine_id = worker.engine_id
    runtime = worker.runtime
    model_id = runtime.model_id if runtime else None
    helpable = led = None
    if model_id:
        helpable = Batch.objects.to_help(model_id, engine_id).first()
        led = Batch.objects.led_elsewhere(model_id, engine_id).first()
    # A batch led elsewhere comes first: a newer one led here would want the model's lease too,
    # which the older one holds (one live lease per model).
    with transaction.atomic():
        batch = Batch.objects.to_run(model_id).claim_oldest(engine_id, running_before=led.created_at if led else None)
        if batch is not None:
            leader = Leader(worker)
            runs_rows = batch.status == Batch.Status.IN_PROGRESS and not batch.end_status
            return batch, leader, leader.check(batch) if runs_rows else None
    return (helpable, Helper(worker), None) if helpable is not None else (None, None, None)


async def wake_replicas(batch, engine_id):
    """The other running engines with the batch's model resident look at it now, not at their
    next poll (BATCH_WAIT_POLL_S): each replica helps from its first chunk (SPEC 10c)."""
    layer = get_channel_layer()
    for channel in await sync_to_async(replica_channels)(batch, engine_id):
        try:
            await layer.send(channel, {"type": "wake"})
        except Exception:
            log.debug("could not wake %s; it polls anyway", channel, exc_info=True)


def replica_channels(batch, engine_id):
    """The channels of the other running engines with the in-progress batch's model resident."""
    model = Batch.objects.filter(pk=batch.pk, status=Batch.Status.IN_PROGRESS).values_list("model", flat=True).first()
    if model is None:
        return []
    return list(Engine.objects.running().filter(resident_model_id=model).exclude(pk=engine_id)
                .values_list("channel", flat=True))
