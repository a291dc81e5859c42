"""Socket.IO at /socket.io/ (python-socketio), so the original's clients keep working:
`socket.on("batch:progress", ...)`, and `socket.emit("join", "<batch id>")` for one batch.

A client hears the batches of its key's project (an admin project's key or a staff session:
every batch), in the rooms `batches_app.events.rooms_for` names; joining another project's
batch is answered as for an unknown id (SPEC 10d).

Every web process runs this server on python-socketio's Redis manager; whoever publishes a
`batch:progress` (the engine, or web on create and cancel) emits through a write-only manager
on the same Redis channel, so every connected client hears it whatever process it is on.
"""

from http.cookies import CookieError, SimpleCookie
from importlib import import_module

import socketio
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user
from django.http import HttpRequest

from inference_app.events import socketio_channel
from millm_lib.keys import origin_allowed, socket_key
from projects_app.access import project_for_key

MODELS_ROOM = "models"  # model:load:progress, model:load:complete, model:load:error, model:unload:complete


def _origin_allowed(origin, environ):
    """The site's own origin, or one MILLM_ALLOWED_ORIGINS names (engine.io asks before a connect)."""
    return origin_allowed(origin, environ.get("HTTP_HOST", ""), settings.MILLM_ALLOWED_ORIGINS)


sio = socketio.AsyncServer(
    async_mode="asgi",
    client_manager=socketio.AsyncRedisManager(settings.REDIS_URL, channel=socketio_channel()),
    cors_allowed_origins=_origin_allowed,
)


def staff_session(cookie_header):
    """True when the request's session cookie is an active staff user's (the admin's own page)."""
    try:
        cookies = SimpleCookie()
        cookies.load(cookie_header or "")
    except CookieError:
        return False
    morsel = cookies.get(settings.SESSION_COOKIE_NAME)
    if morsel is None:
        return False
    request = HttpRequest()
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(morsel.value)
    user = get_user(request)
    return user.is_active and user.is_staff


@sio.event
async def connect(sid, environ, auth):
    from batches_app import events

    if await sync_to_async(staff_session)(environ.get("HTTP_COOKIE", "")):
        project = None  # sees every batch
    else:
        token = socket_key(environ.get("HTTP_AUTHORIZATION", ""), environ.get("QUERY_STRING", ""), auth)
        project = await sync_to_async(project_for_key)(token)
        if project is None:
            raise socketio.exceptions.ConnectionRefusedError("an active API key is needed")
    await sio.save_session(sid, {"project": project})
    for room in events.rooms_for(project):
        await sio.enter_room(sid, room)
    await sio.enter_room(sid, MODELS_ROOM)


@sio.event
async def join(sid, batch_id):
    """Follow one batch of the client's project: leave its project's (or the all-batches) room,
    join `batch:<id>`, get its state now. Another project's batch is an unknown id."""
    from batches_app import events
    from batches_app.models import Batch

    project = (await sio.get_session(sid))["project"]
    batch = await sync_to_async(Batch.objects.owned_by(project).filter(pk=str(batch_id)).first)()
    if batch is None:
        return {"ok": False, "error": f"No batch has the id '{batch_id}'"}
    for room in events.rooms_for(project):
        await sio.leave_room(sid, room)
    await sio.enter_room(sid, events.batch_room(batch.id))
    await sio.emit(events.EVENT, events.progress(batch), to=sid)
    return {"ok": True}


application = socketio.ASGIApp(sio, socketio_path="socket.io")
