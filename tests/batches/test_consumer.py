"""The WebSocket consumer in-process, with Channels' WebsocketCommunicator, on the real Redis
channel layer and the real database."""

import asyncio
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connections
from django.utils import timezone

from batches_app import events
from batches_app.models import Batch
from batches_app.routing import websocket_urlpatterns
from files_app.models import File
from millm_lib.ids import new_id


@pytest.fixture(autouse=True)
def isolated_layer(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}
    settings.CHANNEL_LAYERS = {"default": {**settings.CHANNEL_LAYERS["default"],
                                           "CONFIG": {**settings.CHANNEL_LAYERS["default"]["CONFIG"], "prefix": new_id("t")}}}


async def close_consumer_connections():
    """The consumer's queries ran in asgiref's database thread: close that thread's connection,
    so the test database can be dropped at the end."""
    await database_sync_to_async(connections.close_all)()


def a_batch():
    upload = SimpleUploadedFile("in.jsonl", b"{}\n")
    upload.line_count = 1
    file, _ = File.record(upload, File.Purpose.BATCH, 3600)
    return Batch.objects.create(id=new_id("batch_"), endpoint="/v1/completions", input_file=file, completion_window="24h",
                                status=Batch.Status.IN_PROGRESS, expires_at=timezone.now() + timedelta(hours=1),
                                total=10, completed=3, waiting_reason=Batch.Waiting.QUEUED)


@pytest.mark.django_db(transaction=True)
def test_the_consumer_sends_the_current_state_then_each_event():
    batch = a_batch()

    async def scenario():
        communicator = WebsocketCommunicator(URLRouter(websocket_urlpatterns), f"/ws/batches/{batch.id}/")
        connected, _ = await communicator.connect()
        assert connected
        first = await communicator.receive_json_from(timeout=5)
        await asyncio.sleep(0.1)
        batch.completed = 7
        batch.waiting_reason = None
        await events.apublish(batch)
        second = await communicator.receive_json_from(timeout=5)
        await communicator.disconnect()
        await close_consumer_connections()
        return first, second

    first, second = asyncio.run(scenario())
    assert first == {"event": "batch:progress", "data": {"id": batch.id, "status": "in_progress",
                                                          "request_counts": {"total": 10, "completed": 3, "failed": 0},
                                                          "waiting_reason": "queued"}}
    assert second["data"]["request_counts"]["completed"] == 7 and second["data"]["waiting_reason"] is None


@pytest.mark.django_db(transaction=True)
def test_with_keys_set_the_consumer_refuses_a_client_without_one(settings):
    settings.MILLM_API_KEYS = ["k1"]

    async def scenario():
        refused = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/batches/")
        allowed = WebsocketCommunicator(URLRouter(websocket_urlpatterns), "/ws/batches/?token=k1")
        outcome = (await refused.connect())[0], (await allowed.connect())[0]
        await allowed.disconnect()
        await close_consumer_connections()
        return outcome

    assert asyncio.run(scenario()) == (False, True)
