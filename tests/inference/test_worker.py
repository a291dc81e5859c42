"""The Worker's database steps, called directly, without processes."""

import time

import pytest
from django.db import connection
from django.utils import timezone

from inference_app.catalogue import model_source
from inference_app.engine.worker import Worker
from inference_app.models import Engine, ModelEntry


@pytest.fixture
def source(test_model_dir):
    return model_source(str(test_model_dir), "tiny-worker")


@pytest.fixture
def two_engines(source):
    """Two registered engines for the same model; both unregistered after the test."""
    first, second = Worker(source), Worker(source)
    try:
        first.register()
        second.register()
        yield first, second
    finally:
        first.unregister()
        second.unregister()


@pytest.mark.django_db(transaction=True)
def test_only_one_engine_per_model_holds_the_advisory_lock(two_engines):
    first, second = two_engines
    assert first.try_become_active() is True
    assert second.try_become_active() is False
    first.unregister()  # closes its lock connection: the standby may take over
    assert takes_the_lock_within(second, seconds=10)


def takes_the_lock_within(worker, seconds):
    """A standby's polls (one per heartbeat in production): PostgreSQL frees a closed session's
    lock when its backend process exits, a moment after the client closed the connection, so
    the first poll after a close may still find it held (seen once on a loaded machine)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if worker.try_become_active():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.django_db(transaction=True)
def test_an_engine_for_another_model_is_not_blocked(source, test_model_dir):
    first, other = Worker(source), Worker(model_source(str(test_model_dir), "tiny-other"))
    try:
        assert first.try_become_active() and other.try_become_active()
    finally:
        first.unregister()
        other.unregister()


@pytest.mark.django_db(transaction=True)
def test_a_loaded_engine_whose_lock_a_standby_took_is_no_longer_active(two_engines):
    first, second = two_engines
    assert first.try_become_active() is True
    first.load()  # the engine is active now: still_active checks its lock
    assert first.still_active() is True
    # A PostgreSQL restart, as the lock sees it: its connection is cut, so the lock is free.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_locks WHERE locktype = 'advisory' "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    assert second.try_become_active() is True
    assert first.still_active() is False


@pytest.mark.django_db(transaction=True)
def test_load_marks_the_model_resident_and_the_engine_active(source):
    worker = Worker(source)
    worker.register()
    try:
        runtime = worker.load()
        entry = ModelEntry.objects.get(pk="tiny-worker")
        assert entry.state == "resident" and entry.dtype == "float32" and entry.context_length == 1024
        engine = Engine.objects.get(pk=worker.engine_id)
        assert (engine.role, engine.resident_model_id) == ("active", "tiny-worker")
        assert Engine.objects.serving("tiny-worker").pk == worker.engine_id
        assert runtime.model_id == "tiny-worker"
    finally:
        worker.unregister()
    assert ModelEntry.objects.get(pk="tiny-worker").state == "available"
    assert not Engine.objects.filter(pk=worker.engine_id).exists()


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_reregisters_a_deleted_row_and_reports_the_queue(source):
    worker = Worker(source)
    worker.register()
    Engine.objects.all().delete()
    worker.heartbeat()
    engine = Engine.objects.get(pk=worker.engine_id)
    assert engine.heartbeat_at <= timezone.now()
    assert (engine.queue_waiting, engine.in_flight, engine.queue_max_pending) == (0, 0, 10)
    worker.unregister()
