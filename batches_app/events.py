"""`batch:progress` events (SPEC 10, "Progress"), sent after the commit they describe.

The database row is the truth; an event only says "look, this changed". Events go over the
Channels layer to every web process: to the group of all batches and to the batch's own group.
The WebSocket consumer relays them; Socket.IO clients get them through the same layer.
"""

import logging
import time

from django.conf import settings

from inference_app import events as inference_events
from inference_app.gateway import wake_engines

log = logging.getLogger("millm.batches")

EVENT = "batch:progress"
ALL_BATCHES = "millm.batches"


def batch_group(batch_id):
    return f"millm.batch.{batch_id}"


def progress(batch):
    return {
        "id": batch.id,
        "status": batch.status,
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "waiting_reason": batch.waiting_reason if batch.status == "in_progress" else None,
    }


def publish(batch):
    """Send `batch:progress` for `batch` as it is now (from synchronous code)."""
    inference_events.publish(EVENT, progress(batch), [ALL_BATCHES, batch_group(batch.id)], _rooms(batch))


async def apublish(batch):
    await inference_events.apublish(EVENT, progress(batch), [ALL_BATCHES, batch_group(batch.id)], _rooms(batch))


def publish_and_wake(*batches):
    """After a create or a cancel: `batch:progress` for each batch, then one wake, so that the
    engines act now rather than at their next poll (BATCH_WAIT_POLL_S)."""
    for batch in batches:
        publish(batch)
    wake_engines()


def _rooms(batch):
    return ["batches", f"batch:{batch.id}"]


class Throttle:
    """At most one chunk event per BATCH_PROGRESS_MIN_INTERVAL_S per batch; a change of status
    or waiting reason always goes out."""

    def __init__(self):
        self.last = {}

    def due(self, batch):
        key = (batch.status, batch.waiting_reason)
        sent_at, sent_key = self.last.get(batch.id, (0.0, None))
        now = time.monotonic()
        if key != sent_key or now - sent_at >= settings.BATCH_PROGRESS_MIN_INTERVAL_S:
            self.last[batch.id] = (now, key)
            return True
        return False
