"""/metrics' batch series (SPEC 7): batch states, rows by endpoint and outcome, tokens, each
running batch's rate and the backlog by model move with the database."""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from batches_app.models import Batch, BatchRow
from inference_app import backlog
from millm_lib import metrics
from millm_lib.limits import COMPLETIONS
from tests.factories import BatchFactory, BatchRowFactory, FileFactory, requests_of

pytestmark = pytest.mark.django_db


def samples(name):
    """{labels as written: value} of one series in /metrics' text."""
    text = metrics.render().decode()
    return {labels: float(value) for labels, value in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)}


def test_batch_series_move_as_a_batch_runs():
    before = {name: samples(name) for name in ("millm_batches", "millm_batch_rows", "millm_batch_tokens")}
    assert set(before["millm_batches"]) == {f'status="{status}"' for status in Batch.Status.values}

    batch = BatchFactory(input_file=FileFactory(lines=requests_of([{"prompt": "a"}, {"prompt": "b"}])),
                         status=Batch.Status.IN_PROGRESS, model="tiny-llama", total=2, completed=1,
                         in_progress_at=timezone.now() - timedelta(seconds=10), input_tokens=7, output_tokens=3)
    BatchRowFactory(batch=batch, line=1, outcome=BatchRow.Outcome.SUCCEEDED)
    BatchRowFactory(batch=batch, line=2)

    batches, rows, tokens = samples("millm_batches"), samples("millm_batch_rows"), samples("millm_batch_tokens")
    assert batches['status="in_progress"'] == before["millm_batches"]['status="in_progress"'] + 1
    succeeded, pending = (f'endpoint="{COMPLETIONS}",outcome="{outcome}"' for outcome in ("succeeded", "pending"))
    assert rows[succeeded] == before["millm_batch_rows"].get(succeeded, 0) + 1
    assert rows[pending] == before["millm_batch_rows"].get(pending, 0) + 1
    assert tokens['kind="input"'] == before["millm_batch_tokens"]['kind="input"'] + 7
    assert tokens['kind="output"'] == before["millm_batch_tokens"]['kind="output"'] + 3
    rate = samples("millm_batch_rows_per_second")[f'batch="{batch.pk}",model="tiny-llama"']
    assert 0.05 < rate < 0.2  # one row in about ten seconds
    assert samples("millm_batch_backlog_rows") == {'model="tiny-llama",status="in_progress"': 1.0}

    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.COMPLETED)  # a test's shortcut, not a runner's write
    batches = samples("millm_batches")
    assert batches['status="in_progress"'] == before["millm_batches"]['status="in_progress"']
    assert batches['status="completed"'] == before["millm_batches"]['status="completed"'] + 1
    assert not any(batch.pk in labels for labels in samples("millm_batch_rows_per_second"))


def test_the_backlog_counts_each_unrun_row_of_each_active_batch_once():
    """Validating batches with the valid lines read so far (model unknown yet), in-progress ones
    whatever serves their model, and nothing of a batch whose end was asked for (issue 26)."""
    running = BatchFactory(status=Batch.Status.IN_PROGRESS, model="tiny-llama", total=3)
    BatchRowFactory(batch=running, line=1, outcome=BatchRow.Outcome.SUCCEEDED)
    BatchRowFactory(batch=running, line=2)
    BatchRowFactory(batch=running, line=3)
    not_resident = BatchFactory(status=Batch.Status.IN_PROGRESS, model="elsewhere", total=1,
                                waiting_reason=Batch.Waiting.MODEL_NOT_RESIDENT)
    BatchRowFactory(batch=not_resident, line=1)
    validating = BatchFactory()
    for line in (1, 2):  # two lines validated so far, one of them invalid
        BatchRowFactory(batch=validating, line=line, outcome=BatchRow.Outcome.PENDING if line == 1 else BatchRow.Outcome.INVALID)
    ending = BatchFactory(status=Batch.Status.IN_PROGRESS, model="tiny-llama", total=1, end_status=Batch.Status.CANCELLED)
    BatchRowFactory(batch=ending, line=1)  # a cancel was asked for: it will never run
    cancelling = BatchFactory(status=Batch.Status.CANCELLING, model="tiny-llama", total=1)
    BatchRowFactory(batch=cancelling, line=1)

    assert BatchRow.objects.backlog() == {("tiny-llama", "in_progress"): 2, ("elsewhere", "in_progress"): 1,
                                          ("", "validating"): 1}
    assert samples("millm_batch_backlog_rows") == {'model="tiny-llama",status="in_progress"': 2.0,
                                                   'model="elsewhere",status="in_progress"': 1.0,
                                                   'model="",status="validating"': 1.0}
    assert backlog.total_rows() == 4
