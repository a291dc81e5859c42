"""Progress events reach only the batch's owner (issue 18, point 2): on the WebSocket (all batches
and one batch) and on Socket.IO (its rooms and `join`), a connection hears its own project's
batches; an admin project's key and a staff session hear every batch; another project's batch is
treated as an unknown id. The WebSocket through the ASGI application in-process (Channels'
communicator); Socket.IO through the same application served by uvicorn on a thread of this
process, with python-socketio's client."""

import asyncio
import socket
import threading
import time

import pytest
import socketio
import uvicorn
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import User
from django.db import connections

from batches_app import events
from batches_app.models import Batch
from millm_lib.ids import new_id
from millm_site.asgi import application
from millm_site.socketio_app import application as socketio_application
from projects_app.models import Project
from tests.factories import BatchFactory

pytestmark = pytest.mark.django_db(transaction=True)

DEFAULT_KEY = "sk-default"  # MILLM_API_KEYS: the default project, as before projects


@pytest.fixture(autouse=True)
def isolated(settings):
    """Channels groups on a prefix of the test's own (a running server hears none of them), and a
    MILLM_API_KEYS key beside the database keys."""
    settings.MILLM_API_KEYS = [DEFAULT_KEY]
    settings.CHANNEL_LAYERS = {"default": {**settings.CHANNEL_LAYERS["default"],
                                           "CONFIG": {**settings.CHANNEL_LAYERS["default"]["CONFIG"], "prefix": new_id("t")}}}


@pytest.fixture
def batches(teams):
    """An unfinished batch of each team, and one made before projects (the default project's)."""
    def batch(project):
        return BatchFactory(project=project, status=Batch.Status.IN_PROGRESS, total=4)

    return {"a": batch(teams.a.project), "b": batch(teams.b.project), "legacy": batch(None)}


@pytest.fixture
def staff_cookie(client):
    client.force_login(User.objects.create_user("staff", password="pw-123456", is_staff=True))
    return f"sessionid={client.cookies['sessionid'].value}"


def listeners(teams, staff_cookie):
    """Who listens, and how they present themselves: (name, Authorization key or None, cookie)."""
    return [("a", teams.a.key, ""), ("b", teams.b.key, ""), ("admin", teams.admin.key, ""),
            ("default", DEFAULT_KEY, ""), ("staff", None, staff_cookie)]


EVERY = {"a", "b", "legacy"}
HEARS = {"a": {"a"}, "b": {"b"}, "admin": EVERY, "default": {"legacy"}, "staff": EVERY}


# --- the WebSocket ---


def websocket(path, key=None, cookie=""):
    headers = [(b"host", b"testserver")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    return WebsocketCommunicator(application, path, headers=headers)


async def heard(communicator, wait=0.4):
    """The batch ids of every event the socket has received until it stays silent for `wait` s
    (receive_nothing never cancels the consumer, as a timed-out receive does)."""
    ids = []
    while not await communicator.receive_nothing(timeout=wait):
        ids.append((await communicator.receive_json_from())["data"]["id"])
    return ids


async def heard_by_each(sockets):
    """{name: what `heard` gives} for every socket, all listened to at once: each still waits
    until it has been silent for `wait` s, but the waits overlap instead of adding up."""
    heard_lists = await asyncio.gather(*(heard(communicator) for communicator in sockets.values()))
    return dict(zip(sockets, heard_lists))


def names(ids, batches):
    return {name for name, batch in batches.items() if batch.id in ids}


def test_the_all_batches_websocket_hears_only_its_projects_batches(teams, batches, staff_cookie):
    async def scenario():
        sockets = {}
        for name, key, cookie in listeners(teams, staff_cookie):
            sockets[name] = websocket("/ws/batches/", key, cookie)
            assert (await sockets[name].connect())[0], name
        snapshots = await heard_by_each(sockets)
        for batch in batches.values():
            batch.completed = 2
            await events.apublish(batch)
        told = await heard_by_each(sockets)
        for communicator in sockets.values():
            await communicator.disconnect()
        await sync_to_async(connections.close_all)()
        return snapshots, told

    snapshots, told = asyncio.run(scenario())
    for name, expected in HEARS.items():
        assert names(snapshots[name], batches) == expected, f"{name}'s snapshot"
        assert names(told[name], batches) == expected and len(told[name]) == len(expected), f"{name}'s events"


def test_another_projects_batch_socket_opens_and_hears_nothing_as_for_an_unknown_id(teams, batches, staff_cookie):
    mine = batches["a"]
    unknown = new_id("batch_")

    async def scenario():
        sockets = {
            "theirs": websocket(f"/ws/batches/{mine.id}/", teams.b.key),
            "unknown": websocket(f"/ws/batches/{unknown}/", teams.b.key),
            "owner": websocket(f"/ws/batches/{mine.id}/", teams.a.key),
            "admin": websocket(f"/ws/batches/{mine.id}/", teams.admin.key),
            "staff": websocket(f"/ws/batches/{mine.id}/", cookie=staff_cookie),
        }
        opened = {name: (await communicator.connect())[0] for name, communicator in sockets.items()}
        snapshots = await heard_by_each(sockets)
        await events.apublish(mine)
        told = await heard_by_each(sockets)
        for communicator in sockets.values():
            await communicator.disconnect()
        await sync_to_async(connections.close_all)()
        return opened, snapshots, told

    opened, snapshots, told = asyncio.run(scenario())
    assert all(opened.values())
    assert snapshots["theirs"] == snapshots["unknown"] == told["theirs"] == told["unknown"] == []
    for name in ("owner", "admin", "staff"):
        assert snapshots[name] == told[name] == [mine.id], name


# --- Socket.IO ---


@pytest.fixture
def served():
    """The ASGI application served by uvicorn on a thread of this process: Socket.IO's client
    needs a real socket. Its base URL."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(application, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{listening.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


async def socketio_client(url, key=None, cookie=""):
    client = socketio.AsyncClient()
    client.heard = []
    client.on(events.EVENT, lambda data: client.heard.append(data["id"]))
    await client.connect(url, transports=["websocket"], auth={"token": key} if key else None,
                         headers={"Cookie": cookie} if cookie else {},
                         socketio_path=socketio_application.engineio_path, wait_timeout=10)
    return client


async def until(check, timeout=10):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not heard in time"
        await asyncio.sleep(0.05)


def test_socketio_clients_hear_only_their_projects_batches_and_join_only_their_own(teams, batches, staff_cookie,
                                                                                    served):
    mine, unknown = batches["a"], new_id("batch_")

    async def scenario():
        clients = {name: await socketio_client(served, key, cookie)
                   for name, key, cookie in listeners(teams, staff_cookie)}
        # The server's Redis listener starts with its first client: publish until the staff hears.
        while not clients["staff"].heard:
            await events.apublish(mine)
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        for client in clients.values():
            client.heard.clear()
        for batch in batches.values():
            await events.apublish(batch)
        await until(lambda: names(clients["staff"].heard, batches) == EVERY)
        await asyncio.sleep(0.5)  # time for an event that should not come
        told = {name: list(client.heard) for name, client in clients.items()}

        b = clients["b"]
        joined = {"theirs": await b.call("join", mine.id, timeout=5), "unknown": await b.call("join", unknown, timeout=5)}
        b_owner = clients["a"]
        joined["owner"] = await b_owner.call("join", mine.id, timeout=5)
        await until(lambda: mine.id in b_owner.heard)  # the batch's state, at once
        for client in clients.values():
            await client.disconnect()
        await sync_to_async(connections.close_all)()
        return told, joined

    told, joined = asyncio.run(scenario())
    for name, expected in HEARS.items():
        assert names(told[name], batches) == expected, name
    assert joined["theirs"] == {"ok": False, "error": f"No batch has the id '{mine.id}'"}
    assert joined["unknown"] == {"ok": False, "error": f"No batch has the id '{unknown}'"}
    assert joined["owner"] == {"ok": True}


def test_a_connection_of_a_project_joins_only_its_own_groups_and_rooms(teams):
    default = Project.objects.default()
    assert events.groups_for(None) == events.groups_for(teams.admin.project) == [events.ALL_BATCHES]
    assert events.rooms_for(teams.a.project) == [events.project_room(teams.a.project.pk)]
    assert events.groups_for(default) == [events.project_group(default.pk), events.project_group(None)]
    batch = BatchFactory(project=teams.a.project)
    assert events._rooms(batch) == [events.ALL_ROOM, events.project_room(teams.a.project.pk), events.batch_room(batch.id)]
