"""ASGI entry point: `uvicorn millm_site.asgi:application` (web) or `manage.py runserver`.

HTTP goes to Django behind a guard that refuses an oversize body before reading it;
/socket.io/ (HTTP polling and WebSocket) goes to python-socketio; WebSockets at /ws/batches/ go
to the batch progress consumer.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.exceptions import SuspiciousFileOperation  # noqa: E402
from django.http import Http404  # noqa: E402

from batches_app.routing import websocket_urlpatterns  # noqa: E402
from millm_site.middleware import BodyLimitASGI  # noqa: E402
from millm_site import redaction  # noqa: E402
from millm_site.socketio_app import application as socketio_application  # noqa: E402


# uvicorn logs WebSocket handshakes (path and query) on "uvicorn.error", access lines on "uvicorn.access".
redaction.install("uvicorn.error", "uvicorn.access")


class StaticFiles(ASGIStaticFilesHandler):
    """The admin's CSS and scripts. A path that climbs out of the static folders (`/static/../x`)
    is refused by the finders with SuspiciousFileOperation: a 404 here, not a 500."""

    def serve(self, request):
        try:
            return super().serve(request)
        except SuspiciousFileOperation:
            raise Http404("No such static file") from None


class SocketIORouter:
    """/socket.io/... to python-socketio, everything else to `other`."""

    def __init__(self, other):
        self.other = other

    async def __call__(self, scope, receive, send):
        if scope["path"].startswith("/socket.io"):
            await socketio_application(scope, receive, send)
        else:
            await self.other(scope, receive, send)


application = ProtocolTypeRouter(
    {
        # The admin's own CSS and scripts are served here too: one process to run, no build step.
        "http": SocketIORouter(BodyLimitASGI(StaticFiles(django_application))),
        # The session and user (channels' AuthMiddlewareStack): the admin's live progress needs
        # no key with a staff login.
        "websocket": SocketIORouter(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
