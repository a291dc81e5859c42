"""factory-boy factories for the rows the batch tests start from: files (with real bytes in
storage), batches, batch rows, engines and leases. Each builds what production would have
written, so a test can begin anywhere in a batch's life (validating, half-run, cancelling)."""

import json
import secrets
import uuid
from datetime import timedelta

import factory
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches_app.models import Batch, BatchRow
from files_app.models import File
from inference_app.models import Engine, Lease
from millm_lib.ids import new_id
from millm_lib.limits import COMPLETIONS


def request_line(body, custom_id, endpoint=COMPLETIONS):
    """One line of a batch input file, as a client writes it."""
    return {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}


def jsonl(lines):
    """The bytes of a JSONL file: a dict is one JSON line, a str is written as it is (a bad line)."""
    return b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines)


class FileFactory(factory.django.DjangoModelFactory):
    """A batch input file, stored through `File.record` as an upload is: its bytes in storage.

    `lines`: dicts (each a JSON line) or raw strings; `FileFactory(lines=requests_of(bodies))`."""

    class Meta:
        model = File

    lines = factory.LazyFunction(list)
    purpose = File.Purpose.BATCH
    expires_after_seconds = 86_400

    @classmethod
    def _create(cls, model_class, lines, purpose, expires_after_seconds):
        upload = SimpleUploadedFile("input.jsonl", jsonl(lines))
        upload.line_count = len(lines)
        file, _ = File.record(upload, purpose, expires_after_seconds)
        return file


def requests_of(bodies, endpoint=COMPLETIONS):
    """Request lines for `bodies`, with custom ids row-1, row-2, ... (a str body is a bad line)."""
    return [body if isinstance(body, str) else request_line(body, f"row-{number}", endpoint)
            for number, body in enumerate(bodies, start=1)]


class BatchFactory(factory.django.DjangoModelFactory):
    """A batch as `POST /v1/batches` creates it (validating); pass `status`, `model`,
    `in_progress_at` and the counts for a later point of its life."""

    class Meta:
        model = Batch

    id = factory.LazyFunction(lambda: new_id("batch_"))
    endpoint = COMPLETIONS
    input_file = factory.SubFactory(FileFactory)
    completion_window = "24h"
    created_at = factory.LazyFunction(timezone.now)
    expires_at = factory.LazyAttribute(lambda batch: batch.created_at + timedelta(hours=24))


class BatchRowFactory(factory.django.DjangoModelFactory):
    """A validated, pending row."""

    class Meta:
        model = BatchRow

    batch = factory.SubFactory(BatchFactory)
    line = factory.Sequence(lambda number: number + 1)
    custom_id = factory.LazyAttribute(lambda row: f"row-{row.line}")
    body = None


class EngineFactory(factory.django.DjangoModelFactory):
    """An engine's row; `EngineFactory(stale=True)` is one whose process is gone (its heartbeat
    is older than ENGINE_STALE_S)."""

    class Meta:
        model = Engine

    class Params:
        stale = factory.Trait(heartbeat_at=factory.LazyFunction(lambda: timezone.now() - timedelta(hours=1)))

    id = factory.LazyFunction(lambda: new_id("eng_"))
    host = "test-host"
    pid = factory.Sequence(lambda number: 10_000 + number)
    channel = factory.LazyAttribute(lambda engine: f"millm.engine.{engine.id}")
    model_id = "tiny-llama"
    role = Engine.Role.ACTIVE
    heartbeat_at = factory.LazyFunction(timezone.now)


class LeaseFactory(factory.django.DjangoModelFactory):
    """A live lease; `holder="millm-batch:<id>"` for one a batch took, any other for an outside
    holder's."""

    class Meta:
        model = Lease

    id_hash = factory.LazyFunction(lambda: secrets.token_hex(32))
    model_id = "tiny-llama"
    engine_id = factory.LazyFunction(lambda: new_id("eng_"))
    holder = factory.LazyFunction(lambda: f"tester-{uuid.uuid4().hex[:8]}")
    reason = "a test holds the model"
    ttl_seconds = 900
    acquired_at = factory.LazyFunction(timezone.now)
    renewed_at = factory.LazyAttribute(lambda lease: lease.acquired_at)
    expires_at = factory.LazyAttribute(lambda lease: lease.acquired_at + timedelta(seconds=lease.ttl_seconds))
