"""Socket.IO at /socket.io/ (python-socketio), so the original's clients keep working:
`socket.on("batch:progress", ...)`, and `socket.emit("join", "<batch id>")` for one batch.

Every web process runs this server on python-socketio's Redis manager; whoever publishes a
`batch:progress` (the engine, or web on create and cancel) emits through a write-only manager
on the same Redis channel, so every connected client hears it whatever process it is on.
"""

import socketio
from asgiref.sync import sync_to_async
from django.conf import settings

from inference_app.events import socketio_channel
from millm_lib.keys import key_is_valid, socket_key

ALL_ROOM = "batches"
MODELS_ROOM = "models"  # model:load:progress, model:load:complete, model:load:error, model:unload:complete


sio = socketio.AsyncServer(
    async_mode="asgi",
    client_manager=socketio.AsyncRedisManager(settings.REDIS_URL, channel=socketio_channel()),
    cors_allowed_origins="*",
)


@sio.event
async def connect(sid, environ, auth):
    keys = settings.MILLM_API_KEYS
    if keys:
        token = socket_key(environ.get("HTTP_AUTHORIZATION", ""), environ.get("QUERY_STRING", ""), auth)
        if not token or not key_is_valid(token, keys):
            raise socketio.exceptions.ConnectionRefusedError("a bearer key from MILLM_API_KEYS is needed")
    await sio.enter_room(sid, ALL_ROOM)
    await sio.enter_room(sid, MODELS_ROOM)


@sio.event
async def join(sid, batch_id):
    """Follow one batch: leave the all-batches room, join `batch:<id>`, get its state now."""
    from batches_app import events
    from batches_app.models import Batch

    batch = await sync_to_async(Batch.objects.filter(pk=str(batch_id)).first)()
    if batch is None:
        return {"ok": False, "error": f"No batch has the id '{batch_id}'"}
    await sio.leave_room(sid, ALL_ROOM)
    await sio.enter_room(sid, f"batch:{batch.id}")
    await sio.emit(events.EVENT, events.progress(batch), to=sid)
    return {"ok": True}


application = socketio.ASGIApp(sio, socketio_path="socket.io")
