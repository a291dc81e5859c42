"""Fixtures for the in-process batch tests: a real engine `Worker` (registered, its model
resident, the `BatchRunner` as its companion), started as `runbatchworker` starts it; the
helpers that drive it are in `tests/batches/inprocess.py`."""

import pytest

from batches_app.runner import BatchRunner
from inference_app.catalogue import model_source
from inference_app.engine import residency
from inference_app.engine.worker import Worker
from millm_lib.ids import new_id


@pytest.fixture
def inprocess_settings(settings, tmp_path):
    """Files in a folder of the test's own, events on a channel prefix of its own (a running
    server hears none of them), and the runner's idle poll short so a test waits milliseconds."""
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
    prefix = new_id("t")
    settings.CHANNEL_PREFIX = prefix
    settings.CHANNEL_LAYERS = {"default": {**settings.CHANNEL_LAYERS["default"],
                                           "CONFIG": {**settings.CHANNEL_LAYERS["default"]["CONFIG"], "prefix": prefix}}}
    settings.BATCH_WAIT_POLL_S = 0.05
    return settings


@pytest.fixture
def start_engine(resident, test_model_dir, monkeypatch, inprocess_settings):
    """`start_engine(model_id, runner=BatchRunner)`: an engine as `runbatchworker` builds it,
    registered and with its model resident. Its load step runs for real (the rows it writes are
    production's), but hands out the model the session loaded once through the production
    loader, so a test does not pay for a load."""
    monkeypatch.setattr(residency, "load_model", lambda source: resident.loaded)
    started = []

    def start(model_id=resident.model_id, runner=BatchRunner):
        worker = Worker(model_source(str(test_model_dir), model_id), companions=[runner])
        started.append(worker)
        worker.register()
        worker.load(startup=True)
        return worker

    yield start
    for worker in started:
        worker.unregister()
        worker.seating.shutdown()
