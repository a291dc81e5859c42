"""The Worker's database steps, called directly, without processes."""

import pytest
from django.utils import timezone

from inference_app.catalogue import model_source
from inference_app.engine.worker import Worker
from inference_app.models import Engine, ModelEntry


@pytest.fixture
def source(test_model_dir):
    return model_source(str(test_model_dir), "tiny-worker")


@pytest.mark.django_db(transaction=True)
def test_only_one_engine_per_model_holds_the_advisory_lock(source):
    first, second = Worker(source), Worker(source)
    try:
        first.register()
        second.register()
        assert first.try_become_active() is True
        assert second.try_become_active() is False
        first.unregister()  # closes its lock connection: the standby may take over
        assert second.try_become_active() is True
    finally:
        second.unregister()


@pytest.mark.django_db(transaction=True)
def test_an_engine_for_another_model_is_not_blocked(source, test_model_dir):
    first, other = Worker(source), Worker(model_source(str(test_model_dir), "tiny-other"))
    try:
        assert first.try_become_active() and other.try_become_active()
    finally:
        first.unregister()
        other.unregister()


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
