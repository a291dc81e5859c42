"""The gateway's wait for an engine's answer, over the real Redis channel layer: an answer that
arrives while the gateway checks the engine's heartbeat is never lost."""

import asyncio
import random
import threading
import uuid
from datetime import timedelta

import pytest
from channels.layers import get_channel_layer
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from inference_app import gateway
from millm_lib import db
from inference_app.models import Engine

REQUESTS = 200


async def exchange(engine, count):
    """`count` forwarded requests at once, each answered by a stand-in engine loop after 0-5 ms;
    returns how many got their own answer within 20 s."""
    layer = get_channel_layer()
    rng = random.Random(7)

    async def answer(message):
        await asyncio.sleep(rng.uniform(0, 0.005))
        await layer.send(message["reply"], {"type": "result", "body": {"id": message["id"]}, "headers": {}})

    async def engine_loop():
        answering = []
        for _ in range(count):
            answering.append(asyncio.create_task(answer(await layer.receive(engine.channel))))
        await asyncio.gather(*answering)

    async def one(index):
        request_id = f"req_{index}"
        try:
            body, _ = await asyncio.wait_for(gateway.call(engine, "/v1/completions", b"{}", True, request_id), 20)
        except TimeoutError:
            return False
        return body == {"id": request_id}

    serving = asyncio.create_task(engine_loop())
    answered = await asyncio.gather(*(one(index) for index in range(count)))
    await serving
    return sum(answered)


@pytest.fixture
def db_pool_closed_after():
    """The gateway's database threads close their connections afterwards, so that the test
    database can be dropped: one task per thread, held at a barrier until each thread has one."""
    yield
    threads = db.db_pool._max_workers
    barrier = threading.Barrier(threads)

    def close():
        connection.close()
        barrier.wait(timeout=10)

    for future in [db.db_pool.submit(close) for _ in range(threads)]:
        future.result()


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("db_pool_closed_after")
def test_no_answer_is_lost_while_the_gateway_checks_the_engine_heartbeat():
    # The heartbeat is checked after every ENGINE_STALE_S without an answer: here every
    # millisecond, so answers keep arriving in the middle of a check. (The row's heartbeat is
    # set ahead so that it stays live for such a short ENGINE_STALE_S.)
    engine = Engine.objects.create(
        id=f"eng_{uuid.uuid4().hex[:24]}", host="test", pid=1, channel=f"millm-test.engine.{uuid.uuid4().hex}",
        model_id="tiny", resident_model_id="tiny", role=Engine.Role.ACTIVE,
        heartbeat_at=timezone.now() + timedelta(hours=1),
    )
    with override_settings(ENGINE_STALE_S=0.001):
        answered = asyncio.run(exchange(engine, REQUESTS))
    assert answered == REQUESTS


@pytest.mark.django_db
def test_a_request_goes_to_the_replica_with_the_least_work_counting_this_process_own_requests():
    from tests.factories import EngineFactory

    busy = EngineFactory(resident_model_id="m", queue_waiting=3, in_flight=1)
    idle = EngineFactory(resident_model_id="m")
    quiet = EngineFactory(resident_model_id="m", in_flight=1)
    assert gateway.least_busy([busy, idle, quiet]) == idle
    gateway._in_flight[idle.pk] += 2  # this web process sent it two that the heartbeat has not shown yet
    try:
        assert gateway.least_busy([busy, idle, quiet]) == quiet
    finally:
        del gateway._in_flight[idle.pk]
