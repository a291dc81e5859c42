"""Row claims (SPEC 10c): any replica of a batch's model claims chunks of its rows with SKIP
LOCKED, each chunk under a token of its own; a row is recorded only under the claim that took
it, once; a helper's chunk is refused once the batch is ending; a dead engine's claims are
freed."""

import psycopg
import pytest
from django.utils import timezone

from batches_app.models import Batch, BatchRow, FencedOut, RowResult
from millm_lib.db import conninfo
from tests.factories import BatchFactory, BatchRowFactory, EngineFactory

pytestmark = pytest.mark.django_db(transaction=True)


def a_running_batch(rows=6, **fields):
    batch = BatchFactory(status=Batch.Status.IN_PROGRESS, model="tiny-llama", total=rows, in_progress_at=timezone.now(),
                         **fields)
    for line in range(1, rows + 1):
        BatchRowFactory(batch=batch, line=line)
    return batch


def succeeded(rows):
    return [RowResult(row, BatchRow.Outcome.SUCCEEDED, {"ok": True}, None, f"req_{row.line}", False, None, {})
            for row in rows]


def test_two_replicas_claim_disjoint_chunks_and_each_sees_only_its_own_and_free_rows():
    leader, helper = EngineFactory(), EngineFactory()
    batch = a_running_batch()
    mine = BatchRow.objects.claim(list(batch.rows.claimable(leader.pk)[:3]), leader.pk)
    theirs = BatchRow.objects.claim(list(batch.rows.claimable(helper.pk)[:3]), helper.pk)
    assert [row.line for row in mine] == [1, 2, 3] and [row.line for row in theirs] == [4, 5, 6]
    assert mine[0].claim_token != theirs[0].claim_token
    assert list(batch.rows.claimable(helper.pk).values_list("line", flat=True)) == [4, 5, 6]
    # A row another replica claimed is not taken, even when asked for by name.
    again = BatchRow.objects.claim(list(batch.rows.filter(line__in=[1, 4]).order_by("line")), helper.pk)
    assert [row.line for row in again] == [4]
    assert batch.rows.get(line=1).claimed_by == leader.pk


def test_a_row_locked_by_another_connection_is_skipped_not_waited_for():
    engine = EngineFactory()
    batch = a_running_batch(rows=3)
    first = batch.rows.get(line=1)
    with psycopg.connect(conninfo()) as other:
        other.execute("SELECT id FROM batches_app_batchrow WHERE id = %s FOR UPDATE", [first.pk])
        got = BatchRow.objects.claim(list(batch.rows.unrecorded()), engine.pk)  # would hang without SKIP LOCKED
    assert [row.line for row in got] == [2, 3]


def test_a_chunk_is_recorded_only_under_the_token_that_claimed_it():
    engine = EngineFactory()
    batch = a_running_batch(rows=2)
    batch.claim(engine.pk)
    rows = BatchRow.objects.claim(list(batch.rows.unrecorded()), engine.pk)
    # The claim lapsed and the row was claimed again (by us, under a new token): the old chunk's
    # result must not land.
    BatchRow.objects.release_claims(engine.pk, [rows[0]])
    BatchRow.objects.claim([BatchRow.objects.get(pk=rows[0].pk)], engine.pk)
    batch.record_chunk(succeeded([rows[0]]), 1, engine.pk)  # not written, not counted
    assert batch.rows.get(line=1).outcome == BatchRow.Outcome.PENDING
    assert Batch.objects.get(pk=batch.pk).completed == 0
    batch.record_chunk(succeeded([rows[1]]), 2, engine.pk)
    recorded = batch.rows.get(line=2)
    assert (recorded.outcome, recorded.ran_by, recorded.claimed_by, recorded.claim_token) == (
        BatchRow.Outcome.SUCCEEDED, engine.pk, None, None)
    assert Batch.objects.get(pk=batch.pk).completed == 1


def test_a_helpers_chunk_lands_while_the_batch_runs_and_is_refused_once_it_is_ending():
    leader, helper = EngineFactory(), EngineFactory()
    batch = a_running_batch(rows=4)
    batch.claim(leader.pk)
    helping = Batch.objects.get(pk=batch.pk)
    rows = BatchRow.objects.claim(list(batch.rows.unrecorded()), helper.pk)
    helping.record_chunk(succeeded(rows[:2]), 1, helper.pk, leading=False)
    assert batch.rows.filter(ran_by=helper.pk).count() == 2
    batch.mark_ending(Batch.Status.CANCELLED)  # the leader saw a cancel: assembly reads the rows next
    with pytest.raises(FencedOut):
        helping.record_chunk(succeeded(rows[2:]), 2, helper.pk, leading=False)
    assert batch.rows.unrecorded().count() == 2 and Batch.objects.get(pk=batch.pk).completed == 2


def test_rows_another_replica_claimed_are_not_written_by_the_leader():
    leader, helper = EngineFactory(), EngineFactory()
    batch = a_running_batch(rows=2)
    batch.claim(leader.pk)
    rows = BatchRow.objects.claim(list(batch.rows.unrecorded()), helper.pk)
    Batch.objects.get(pk=batch.pk).record_chunk(succeeded(rows), 1, leader.pk)
    assert batch.rows.unrecorded().count() == 2 and Batch.objects.get(pk=batch.pk).completed == 0
    Batch.objects.get(pk=batch.pk).record_chunk(succeeded(rows), 2, helper.pk, leading=False)
    assert set(batch.rows.values_list("ran_by", flat=True)) == {helper.pk}
    assert Batch.objects.get(pk=batch.pk).completed == 2


def test_claims_of_a_dead_or_demoted_engine_are_freed_and_a_running_ones_kept():
    running, dead, demoted = EngineFactory(), EngineFactory(stale=True), EngineFactory(role="standby")
    batch = a_running_batch(rows=3)
    for engine, line in ((running, 1), (dead, 2), (demoted, 3)):
        BatchRow.objects.claim([batch.rows.get(line=line)], engine.pk)
    assert BatchRow.objects.release_dead_claims() == 2
    assert dict(batch.rows.values_list("line", "claimed_by")) == {1: running.pk, 2: None, 3: None}


def test_a_batch_another_replica_leads_is_helped_only_while_it_has_free_rows():
    me, leader = EngineFactory(), EngineFactory()
    batch = a_running_batch(rows=2)
    batch.claim(leader.pk)
    assert list(Batch.objects.to_help("tiny-llama", me.pk)) == [batch]
    assert list(Batch.objects.to_help("tiny-llama", leader.pk)) == []  # its own lead
    assert list(Batch.objects.to_help("another-model", me.pk)) == []
    BatchRow.objects.claim(list(batch.rows.all()), leader.pk)
    assert list(Batch.objects.to_help("tiny-llama", me.pk)) == []
