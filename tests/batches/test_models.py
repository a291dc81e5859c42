"""Batch state on the real database: retention spares referenced files, transitions are CAS."""

from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import IntegrityError
from django.utils import timezone

from batches_app.models import Batch, BatchRow
from batches_app.runner import reconcile_batches
from files_app.models import File
from files_app.retention import prune_files
from millm_lib.errors import ApiError
from millm_lib.ids import new_id


@pytest.fixture(autouse=True)
def storage_in_tmp(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}


def a_file():
    upload = SimpleUploadedFile("in.jsonl", b"{}\n")
    upload.line_count = 1
    file, _ = File.record(upload, File.Purpose.BATCH, 3600)
    return file


def a_batch(file, status=Batch.Status.IN_PROGRESS, **fields):
    return Batch.objects.create(id=new_id("batch_"), endpoint="/v1/completions",
                                input_file=file, completion_window="24h", status=status,
                                expires_at=timezone.now() + timedelta(hours=24), **fields)


@pytest.mark.django_db
def test_the_pruner_spares_a_file_an_unfinished_batch_references():
    referenced, alone = a_file(), a_file()
    batch = a_batch(referenced)
    later = timezone.now() + timedelta(hours=2)
    assert prune_files(later) == [alone.pk]
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.COMPLETED)
    assert prune_files(later) == [referenced.pk]


@pytest.mark.django_db
def test_a_second_row_for_a_line_or_a_valid_custom_id_is_refused_by_the_database():
    batch = a_batch(a_file())
    BatchRow.objects.create(batch=batch, line=1, custom_id="a")
    with pytest.raises(IntegrityError):
        BatchRow.objects.create(batch=batch, line=1, custom_id="b")


@pytest.mark.django_db
def test_invalid_rows_may_repeat_a_custom_id_but_valid_ones_may_not():
    batch = a_batch(a_file())
    BatchRow.objects.create(batch=batch, line=1, custom_id="a")
    BatchRow.objects.create(batch=batch, line=2, custom_id="a", outcome=BatchRow.Outcome.INVALID)
    with pytest.raises(IntegrityError):
        BatchRow.objects.create(batch=batch, line=3, custom_id="a")


@pytest.mark.django_db
def test_cancel_is_a_compare_and_set_and_409s_once_ended():
    batch = a_batch(a_file())
    assert batch.request_cancel().status == "cancelling"
    assert batch.request_cancel().status == "cancelling"  # cancel of cancelling answers it again
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.CANCELLED)
    with pytest.raises(ApiError) as caught:
        Batch.objects.get(pk=batch.pk).request_cancel()
    assert caught.value.code == "batch_state_conflict" and "cancelled" in caught.value.message


@pytest.mark.django_db
def test_reconciliation_releases_claims_on_our_model_and_of_dead_engines_only():
    file = a_file()
    ours = a_batch(file, model="m", claimed_by="eng_dead", claim_token="00000000-0000-0000-0000-000000000001")
    elsewhere = a_batch(file, model="other", claimed_by="eng_gone", claim_token="00000000-0000-0000-0000-000000000002")
    assert reconcile_batches("eng_me", "m") == 2
    assert Batch.objects.get(pk=ours.pk).claimed_by is None
    assert Batch.objects.get(pk=elsewhere.pk).claimed_by is None


@pytest.mark.django_db(transaction=True)  # the sweep closes old connections, as in the engine
def test_an_idle_poll_is_one_query_until_a_batch_is_unfinished(django_assert_num_queries):
    from batches_app.sweep import Sweep
    from tests.factories import BatchFactory

    sweep = Sweep()
    BatchFactory(status=Batch.Status.COMPLETED)
    with django_assert_num_queries(1):
        assert sweep.anything_to_do() is False  # only ended batches: the sweep and the claims are skipped
    unfinished = BatchFactory(status=Batch.Status.VALIDATING)
    assert sweep.anything_to_do() is True
    unfinished.status = Batch.Status.CANCELLED
    unfinished.save()
    assert sweep.anything_to_do() is False
    sweep.unreleased[unfinished.pk] = unfinished  # a claim we still owe a release
    assert sweep.anything_to_do() is True
