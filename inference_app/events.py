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
    """The same, from synchronous code (web's views, the engine's worker threads)."""
    message = {"type": "relay.event", "event": event, "data": data}
    try:
        layer = get_channel_layer()
        for group in groups:
            async_to_sync(layer.group_send)(group, message)
        _sync_socketio().emit(event, data, room=rooms)
    except Exception:
        log.warning("could not send %s", event, exc_info=True)


def _socketio():
    """A write-only manager on the web processes' Redis channel, for the engine's one event
    loop (a manager's connections belong to the loop that made them)."""
    loop = asyncio.get_running_loop()
    if loop not in _managers:
        _managers.clear()
        _managers[loop] = socketio.AsyncRedisManager(settings.REDIS_URL, channel=socketio_channel(), write_only=True)
    return _managers[loop]


_sync_manager = []


def _sync_socketio():
    if not _sync_manager:
        _sync_manager.append(socketio.RedisManager(settings.REDIS_URL, channel=socketio_channel(), write_only=True))
    return _sync_manager[0]
