"""Events to every web process, after the change they describe is committed.

One publisher for batch progress and model lifecycle events: a Channels-layer group message
(the WebSocket consumers relay it) and a Socket.IO emit through python-socketio's write-only
Redis manager (every web process's Socket.IO server hears it). Best effort: the database row
stays the truth, and a client that connects late first receives a snapshot.
"""

import asyncio
import logging

import socketio
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings

log = logging.getLogger("millm.events")

MODELS_GROUP = "millm.models"
_managers = {}


def socketio_channel():
    return f"{settings.CHANNEL_PREFIX}-socketio"


async def apublish(event, data, groups=(), rooms=None):
    message = {"type": "relay.event", "event": event, "data": data}
    layer = get_channel_layer()
    try:
        for group in groups:
            await layer.group_send(group, message)
        await _socketio().emit(event, data, room=rooms)
    except Exception:
        log.warning("could not send %s", event, exc_info=True)


def publish(event, data, groups=(), rooms=None):
    async_to_sync(apublish)(event, data, groups, rooms)


def _socketio():
    """A write-only manager on the web processes' Redis channel (one per event loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _managers:
        _managers[loop] = socketio.AsyncRedisManager(settings.REDIS_URL, channel=socketio_channel(), write_only=True)
    return _managers[loop]
