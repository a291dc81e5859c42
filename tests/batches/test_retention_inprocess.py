"""Results retention (issue 16, point 1): once its files are recorded a batch's rows keep only
what the console and resume need, and ended batches go BATCH_RETENTION_DAYS after they end."""

from datetime import timedelta
from io import StringIO

import pytest
import time_machine
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from batches_app.models import Batch, BatchRow
from millm_lib.limits import EMBEDDINGS
from tests.batches.inprocess import MODEL, batch_is, generation, run_engine_until
from tests.factories import BatchFactory, BatchRowFactory, FileFactory, requests_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("inprocess_settings")]


def row_bytes(batch_id):
    """(rows still holding a body, a response, an error or headers; the bytes of every row)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE body IS NOT NULL OR response IS NOT NULL OR error IS NOT NULL "
            "OR headers IS NOT NULL), coalesce(sum(pg_column_size(r.*)), 0) FROM batches_app_batchrow r WHERE batch_id = %s",
            [batch_id],
        )
        return cursor.fetchone()


def test_a_completed_batchs_rows_keep_no_answer_error_or_header(start_engine):
    lines = requests_of([{"model": MODEL, "input": f"text {n}"} for n in range(6)], EMBEDDINGS)
    embeddings = BatchFactory(input_file=FileFactory(lines=lines), endpoint=EMBEDDINGS)
    failing = BatchFactory(input_file=FileFactory(lines=requests_of([generation("One"), generation("Two", max_tokens=5000)])))
    worker = start_engine()

    run_engine_until(worker, lambda: batch_is(embeddings.pk)() and batch_is(failing.pk)())

    for batch in (embeddings, failing):
        batch = Batch.objects.get(pk=batch.pk)
        assert batch.status == Batch.Status.COMPLETED and batch.output_file is not None
        holding, size = row_bytes(batch.pk)
        assert holding == 0
        assert size < 200 * batch.total  # the goal: a 10,000-row batch leaves under 2 MB; a vector alone is more
        kept = BatchRow.objects.filter(batch=batch).values_list("line", "custom_id", "outcome", "request_id")
        assert all(request_id for *_, request_id in kept) and [line for line, *_ in kept] == list(range(1, batch.total + 1))
    assert Batch.objects.get(pk=failing.pk).error_file is not None  # the error is in the file, not the row


def ended(days_ago, status=Batch.Status.COMPLETED):
    moment = timezone.now() - timedelta(days=days_ago)
    batch = BatchFactory(input_file=FileFactory(lines=[{}]), status=status, created_at=moment - timedelta(hours=1),
                         **{f"{status}_at": moment})
    BatchRowFactory(batch=batch, line=1, outcome=BatchRow.Outcome.SUCCEEDED)
    return batch


def test_ended_batches_go_after_the_retention_with_their_rows_and_unfinished_ones_never(settings):
    settings.BATCH_RETENTION_DAYS = 10
    old = [ended(12), ended(11, Batch.Status.FAILED), ended(11, Batch.Status.CANCELLED), ended(11, Batch.Status.EXPIRED)]
    recent = ended(9)
    running = BatchFactory(input_file=FileFactory(lines=[{}]), status=Batch.Status.IN_PROGRESS,
                           created_at=timezone.now() - timedelta(days=60))
    BatchRowFactory(batch=running, line=1)

    with time_machine.travel(timezone.now(), tick=False):
        out = StringIO()
        call_command("prune", stdout=out)

    assert "deleted 4 batch(es)" in out.getvalue()
    assert set(Batch.objects.values_list("pk", flat=True)) == {recent.pk, running.pk}
    assert not BatchRow.objects.filter(batch_id__in=[batch.pk for batch in old]).exists()
    assert BatchRow.objects.filter(batch=running).count() == 1

    with time_machine.travel(timezone.now() + timedelta(days=2), tick=False):
        call_command("prune", stdout=StringIO())
    assert set(Batch.objects.values_list("pk", flat=True)) == {running.pk}
