"""`batch:progress` events (SPEC 10, "Progress"), sent after the commit they describe.

The database row is the truth; an event only says "look, this changed". Events go over the
Channels layer to every web process: to the group of all batches and to the batch's own group.
The WebSocket consumer relays them; Socket.IO clients get them through the same layer.
"""

import logging
import time

import socketio
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings

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
    """Send `batch:progress` for `batch` as it is now. Best effort: the row stays the truth."""
    async_to_sync(apublish)(batch)


async def apublish(batch):
    data = progress(batch)
    message = {"type": "batch.progress", "event": EVENT, "data": data}
    layer = get_channel_layer()
    try:
        await layer.group_send(ALL_BATCHES, message)
        await layer.group_send(batch_group(batch.id), message)
        await _socketio().emit(EVENT, data, room=["batches", f"batch:{batch.id}"])
    except Exception:
        log.warning("could not send %s for %s", EVENT, batch.id, exc_info=True)


_managers = {}


def _socketio():
    """A write-only Socket.IO manager on the web processes' Redis channel (one per loop)."""
    import asyncio

    from millm_site.socketio_app import redis_channel

    loop = asyncio.get_running_loop()
    if loop not in _managers:
        _managers[loop] = socketio.AsyncRedisManager(settings.REDIS_URL, channel=redis_channel(), write_only=True)
    return _managers[loop]


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
