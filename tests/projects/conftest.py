"""Fixtures for the ownership tests: three projects with a key each (two teams and an admin), and
a real engine answering its channel in a thread, for the routes the engine itself checks."""

import asyncio
import threading
from dataclasses import dataclass

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections

from millm_lib import db
from projects_app.models import ApiKey, Project
from tests.batches import conftest as batch_fixtures

# The in-process engine of the batch tests, for the routes the engine itself checks.
inprocess_settings = batch_fixtures.inprocess_settings
start_engine = batch_fixtures.start_engine


@dataclass
class Team:
    project: Project
    key: str

    def headers(self, **more):
        return {"HTTP_AUTHORIZATION": f"Bearer {self.key}", **more}


@dataclass
class Teams:
    a: Team
    b: Team
    admin: Team


@pytest.fixture
def teams():
    """Projects team-a and team-b and the admin project operators, a key each (once a key exists,
    every route needs one)."""

    def team(name, admin=False):
        project = Project.objects.named(name, admin=admin)
        return Team(project, ApiKey.objects.issue(project)[1])

    return Teams(team("team-a"), team("team-b"), team("operators", admin=True))


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


@pytest.fixture
def serving_engine(start_engine, db_pool_closed_after):
    """A real engine, the test model resident, answering what web forwards (load, unload, weights,
    requests) on an event loop of its own thread, as `Worker.serve` answers it."""
    worker = start_engine()
    loop = asyncio.new_event_loop()
    serving = threading.Event()

    async def serve():
        worker.stopping, worker.nappers = asyncio.Event(), set()  # what `Worker.serve` sets up
        worker.residency.swap_lock = asyncio.Lock()
        serving.set()
        try:
            await worker.serving.consume()
            await worker.serving.drain()
        finally:
            # The engine's queries ran in asgiref's database thread: close its connection, so the
            # test database can be flushed and dropped.
            await sync_to_async(connections.close_all)()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert serving.wait(10)
    yield worker
    loop.call_soon_threadsafe(worker.stopping.set)
    thread.join(30)
    loop.close()
