"""Who may open the live-progress sockets (issue 16, point 3): with MILLM_API_KEYS set, a key or
a staff session (the admin's own page sends no key); from the site's own origin, or one
MILLM_ALLOWED_ORIGINS names. The WebSocket through the real ASGI application, in-process."""

import asyncio

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.db import connections

from millm_lib.keys import origin_allowed
from millm_site.asgi import application
from millm_site.socketio_app import _origin_allowed, staff_session

pytestmark = pytest.mark.django_db(transaction=True)

SITE = "http://testserver"


@pytest.fixture(autouse=True)
def keys_set(settings):
    settings.MILLM_API_KEYS = ["sk-right"]
    settings.MILLM_ALLOWED_ORIGINS = ["https://dashboard.example.com"]


def session_cookie(client, staff):
    user = User.objects.create_user("staff" if staff else "someone", password="pw-123456", is_staff=staff)
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}"


def connects(cookie="", origin=SITE, key=""):
    headers = [(b"host", b"testserver")]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    if origin:
        headers.append((b"origin", origin.encode()))
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))

    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/batches/", headers=headers)
        connected, _ = await communicator.connect()
        await communicator.disconnect()
        await database_sync_to_async(connections.close_all)()
        return connected

    return asyncio.run(scenario())


def test_a_staff_session_opens_the_websocket_without_a_key(client):
    assert connects(cookie=session_cookie(client, staff=True))


def test_without_a_key_a_session_that_is_not_staff_or_none_is_refused(client):
    assert not connects(cookie=session_cookie(client, staff=False))
    assert not connects()
    assert connects(key="sk-right")


def test_another_origin_is_refused_unless_allowed_even_with_a_key():
    assert not connects(key="sk-right", origin="https://evil.example")
    assert connects(key="sk-right", origin="https://dashboard.example.com")
    assert connects(key="sk-right", origin="")  # no Origin: not a browser, the key decides


def test_socketio_takes_the_same_session_and_origin_rules(client):
    assert staff_session(session_cookie(client, staff=True))
    assert not staff_session("sessionid=not-a-session") and not staff_session("") and not staff_session("=;;bad")
    environ = {"HTTP_HOST": "testserver"}
    assert _origin_allowed(SITE, environ) and _origin_allowed("https://dashboard.example.com", environ)
    assert not _origin_allowed("https://evil.example", environ)


def test_the_origin_rule():
    assert origin_allowed("http://a.example:8000", "a.example:8000")
    assert not origin_allowed("http://b.example", "a.example:8000")
    assert origin_allowed("http://b.example", "a.example", ["http://b.example"])
    assert origin_allowed(None, "a.example")
