"""/metrics' batch series (SPEC 7): batch states, rows by endpoint and outcome, tokens, each
running batch's rate and each engine's backlog move with the database."""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from batches_app.models import Batch, BatchRow
from inference_app import metrics
from millm_lib.limits import COMPLETIONS
from tests.factories import BatchFactory, BatchRowFactory, EngineFactory, FileFactory, requests_of

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
    EngineFactory(model_id="tiny-llama", batch_backlog_rows=1)

    batches, rows, tokens = samples("millm_batches"), samples("millm_batch_rows"), samples("millm_batch_tokens")
    assert batches['status="in_progress"'] == before["millm_batches"]['status="in_progress"'] + 1
    succeeded, pending = (f'endpoint="{COMPLETIONS}",outcome="{outcome}"' for outcome in ("succeeded", "pending"))
    assert rows[succeeded] == before["millm_batch_rows"].get(succeeded, 0) + 1
    assert rows[pending] == before["millm_batch_rows"].get(pending, 0) + 1
    assert tokens['kind="input"'] == before["millm_batch_tokens"]['kind="input"'] + 7
    assert tokens['kind="output"'] == before["millm_batch_tokens"]['kind="output"'] + 3
    rate = samples("millm_batch_rows_per_second")[f'batch="{batch.pk}",model="tiny-llama"']
    assert 0.05 < rate < 0.2  # one row in about ten seconds
    assert 1.0 in samples("millm_batch_backlog_rows").values()

    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.COMPLETED)  # a test's shortcut, not a runner's write
    batches = samples("millm_batches")
    assert batches['status="in_progress"'] == before["millm_batches"]['status="in_progress"']
    assert batches['status="completed"'] == before["millm_batches"]['status="completed"'] + 1
    assert not any(batch.pk in labels for labels in samples("millm_batch_rows_per_second"))
