"""Assembly in-process (SPEC 10, "Counts and files"): the output and error files of a batch a
real engine ran, assembled again after a restart, and never twice."""

import pytest
from django.utils import timezone

from batches_app import assembly
from batches_app.models import Batch
from files_app.models import File, file_storage
from tests.batches.inprocess import MODEL, batch_is, generation, lines_of, run_and_record, run_engine_until
from tests.factories import BatchFactory, BatchRowFactory, EngineFactory, FileFactory, requests_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("inprocess_settings")]


def stored_names():
    """The storage names of every file's bytes there are."""
    return sorted(f"files/{name}" for name in file_storage().listdir("files")[1])


def files_and_counts(batch_id):
    """Everything an assembly writes: the batch's status, stamps, counts and files (their records,
    their bytes), and every file record and stored name there is."""
    batch = Batch.objects.get(pk=batch_id)
    return {
        "batch": (batch.status, batch.completed_at, batch.output_file_id, batch.error_file_id,
                  batch.total, batch.completed, batch.failed, batch.input_tokens, batch.output_tokens),
        "output": lines_of(batch.output_file),
        "errors": lines_of(batch.error_file),
        "records": sorted(File.objects.values_list("pk", "status")),
        "stored": stored_names(),
    }


def test_assembling_an_ended_batch_again_changes_no_file_and_no_count(start_engine):
    bodies = [generation("One"), generation("Two", max_tokens=5000), generation("Three")]
    batch = BatchFactory(input_file=FileFactory(lines=requests_of(bodies)))
    run_engine_until(start_engine(), batch_is(batch.pk))
    assembled = files_and_counts(batch.pk)
    assert assembled["batch"][0] == Batch.Status.COMPLETED and assembled["batch"][4:7] == (3, 2, 1)

    assembly.assemble(Batch.objects.get(pk=batch.pk))

    assert files_and_counts(batch.pk) == assembled


def test_an_assembly_that_finds_its_batch_ended_meanwhile_records_nothing_and_leaves_no_bytes(start_engine):
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([generation("One")])))
    run_engine_until(start_engine(), batch_is(batch.pk))
    ended = Batch.objects.get(pk=batch.pk)
    assembled = files_and_counts(batch.pk)
    # A copy read before the end (same claim): its assembly gets past the early return and
    # reaches the end's write, which must find the batch ended and write nothing.
    stale = Batch.objects.get(pk=batch.pk)
    stale.status, stale.end_status = Batch.Status.FINALIZING, None
    assert ended.claim_token is not None and stale.claim_token == ended.claim_token

    assembly.assemble(stale)

    assert files_and_counts(batch.pk) == assembled


def test_a_batch_left_finalizing_by_a_dead_engine_is_assembled_once(start_engine, resident):
    bodies = [generation("One"), generation("Two")]
    batch = BatchFactory(input_file=FileFactory(lines=requests_of(bodies)), status=Batch.Status.FINALIZING,
                         model=MODEL, total=2, in_progress_at=timezone.now(), finalizing_at=timezone.now())
    for line, body in enumerate(bodies, start=1):
        BatchRowFactory(batch=batch, line=line, body=body)
    batch.claim(EngineFactory(stale=True).pk)
    run_and_record(batch, resident, batch.rows.unrecorded())
    before = stored_names()

    run_engine_until(start_engine(), batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.COMPLETED and (batch.completed, batch.failed) == (2, 0)
    assert [line["custom_id"] for line in lines_of(batch.output_file)] == ["row-1", "row-2"]
    assert batch.error_file is None
    assert stored_names() == sorted([*before, batch.output_file.storage_name])
