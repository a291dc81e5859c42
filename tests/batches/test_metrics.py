"""/metrics' batch series (SPEC 7): batch states and rows by outcome move with the database."""

import re

import pytest

from batches_app.models import Batch, BatchRow
from inference_app import metrics
from tests.factories import BatchFactory, BatchRowFactory, FileFactory, requests_of

pytestmark = pytest.mark.django_db


def series(name, label):
    text = metrics.render().decode()
    return {match[0]: float(match[1]) for match in re.findall(rf'^{name}\{{{label}="(\w+)"\}} (\S+)$', text, re.M)}


def test_batch_states_and_row_outcomes_move_as_batches_run():
    before_batches, before_rows = series("millm_batches", "status"), series("millm_batch_rows", "outcome")
    assert set(before_batches) == set(Batch.Status.values)
    assert set(before_rows) == set(BatchRow.Outcome.values)

    batch = BatchFactory(input_file=FileFactory(lines=requests_of([{"prompt": "a"}, {"prompt": "b"}])),
                         status=Batch.Status.IN_PROGRESS)
    BatchRowFactory(batch=batch, line=1, outcome=BatchRow.Outcome.SUCCEEDED)
    BatchRowFactory(batch=batch, line=2)

    batches, rows = series("millm_batches", "status"), series("millm_batch_rows", "outcome")
    assert batches["in_progress"] == before_batches["in_progress"] + 1
    assert rows["succeeded"] == before_rows["succeeded"] + 1
    assert rows["pending"] == before_rows["pending"] + 1

    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.COMPLETED)  # a test's shortcut, not a runner's write
    batches = series("millm_batches", "status")
    assert batches["in_progress"] == before_batches["in_progress"]
    assert batches["completed"] == before_batches["completed"] + 1
