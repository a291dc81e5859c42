"""The batch runner in-process, on the tiny model: a batch of a few rows run from its claim to
its files by a real engine Worker, and the engine's restarts, cancels, waits and expiries (SPEC
10), each in seconds instead of the minutes a subprocess test takes."""

import json
import logging
from datetime import timedelta

import jsonschema
import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from batches_app import assembly
from batches_app.models import Batch, BatchRow, FencedOut
from batches_app.runner import BatchRunner
from files_app.models import File, file_storage
from inference_app.engine import services
from inference_app.engine.runtime import ResidentModel
from inference_app.schemas import parse_request
from inference_app.models import Lease
from tests.batches.inprocess import (MODEL, batch_is, executions, generation, lines_of, run_and_record, run_engine_until,
                                     scoring)
from tests.factories import BatchFactory, BatchRowFactory, EngineFactory, FileFactory, LeaseFactory, requests_of
from tests.inference.test_grammars import SCHEMA, schema_format

COMPLETIONS = "/v1/completions"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("inprocess_settings")]


def running_batch(bodies, model=MODEL, **fields):
    """A validated batch in progress, its rows pending, as validation leaves it."""
    batch = BatchFactory(input_file=FileFactory(lines=requests_of(bodies)), status=Batch.Status.IN_PROGRESS,
                         model=model, total=len(bodies), in_progress_at=timezone.now(),
                         waiting_reason=Batch.Waiting.QUEUED, **fields)
    for line, body in enumerate(bodies, start=1):
        BatchRowFactory(batch=batch, line=line, body=body)
    return batch


def left_by_a_dead_engine(batch, runtime, recorded=0):
    """The batch as an engine that died left it: claimed by it, its first `recorded` rows run and
    recorded (by the production path), the rest pending."""
    dead = EngineFactory(stale=True, model_id=batch.model)
    batch.claim(dead.pk)
    if recorded:
        run_and_record(batch, runtime, batch.rows.unrecorded()[:recorded])
    return Batch.objects.get(pk=batch.pk)


def custom_ids(lines):
    return [line["custom_id"] for line in lines]


def test_a_small_batch_runs_from_validation_to_its_output_in_input_order(start_engine):
    bodies = [generation("Once"), scoring("Two"), scoring("Three"), generation("Four")]
    batch = BatchFactory(input_file=FileFactory(lines=requests_of(bodies)))
    engine = start_engine()

    run_engine_until(engine, batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.COMPLETED
    assert (batch.total, batch.completed, batch.failed) == (4, 4, 0)
    assert batch.model == MODEL and batch.error_file is None and batch.errors is None
    assert all((batch.in_progress_at, batch.finalizing_at, batch.completed_at))
    output = lines_of(batch.output_file)
    assert custom_ids(output) == ["row-1", "row-2", "row-3", "row-4"]
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in output)
    assert [line["response"]["body"]["object"] for line in output] == ["text_completion"] * 4
    assert batch.input_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in output)
    assert batch.output_tokens == sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output)
    # It ran under a lease of its own, released at its end; its row bodies are gone (SPEC 10a).
    assert batch.lease_mode == "own" and Lease.objects.get(pk=batch.lease_id).holder == f"millm-batch:{batch.pk}"
    assert not Lease.objects.get(pk=batch.lease_id).live
    assert not batch.rows.exclude(body=None).exists()


def test_it_resumes_from_the_first_unrecorded_row(start_engine, resident, caplog):
    caplog.set_level(logging.INFO, logger="millm.batches.executions")
    batch = running_batch([generation("One"), generation("Two"), scoring("Three"), generation("Four")])
    batch = left_by_a_dead_engine(batch, resident, recorded=2)
    dead = batch.claimed_by
    before = {row.line: (row.request_id, row.recorded_at) for row in batch.rows.exclude(outcome=BatchRow.Outcome.PENDING)}
    assert sorted(before) == [1, 2]

    engine = start_engine()
    run_engine_until(engine, batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.COMPLETED and (batch.completed, batch.failed) == (4, 0)
    after = {row.line: (row.request_id, row.recorded_at) for row in batch.rows.all()}
    assert {line: after[line] for line in before} == before  # not written again ...
    # ... and not run again: the dead engine executed lines 1 and 2 once, the new one the rest.
    assert executions(caplog, batch.pk) == {1: [dead], 2: [dead], 3: [engine.engine_id], 4: [engine.engine_id]}
    output = lines_of(batch.output_file)
    assert custom_ids(output) == ["row-1", "row-2", "row-3", "row-4"]
    assert [line["response"]["request_id"] for line in output[:2]] == [before[1][0], before[2][0]]
    assert len({line["response"]["request_id"] for line in output}) == 4


class CancelsAfterItsFirstChunk(BatchRunner):
    """A client's cancel arrives while the batch runs: just after its first chunk is recorded."""

    async def on_progress(self, batch):
        await super().on_progress(batch)
        if batch.status == Batch.Status.IN_PROGRESS and batch.completed == 1:
            await sync_to_async(lambda: Batch.objects.get(pk=batch.pk).request_cancel())()


def test_a_cancel_mid_batch_ends_it_cancelled_with_the_unrun_rows_in_the_error_file(start_engine):
    batch = running_batch([generation("One"), generation("Two"), generation("Three"), generation("Four")])

    run_engine_until(start_engine(runner=CancelsAfterItsFirstChunk), batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.CANCELLED and batch.cancelling_at and batch.cancelled_at
    # Unrun rows count in neither completed nor failed (SPEC 10, "Counts and files").
    assert (batch.total, batch.completed, batch.failed) == (4, 1, 0)
    assert custom_ids(lines_of(batch.output_file)) == ["row-1"]
    errors = lines_of(batch.error_file)
    assert custom_ids(errors) == ["row-2", "row-3", "row-4"]
    assert [(line["line"], line["response"], line["error"]["code"]) for line in errors] == [
        (2, None, "batch_cancelled"), (3, None, "batch_cancelled"), (4, None, "batch_cancelled")]
    assert not Lease.objects.get(pk=batch.lease_id).live


def test_a_batch_left_validating_by_a_dead_engine_is_validated_again_and_runs(start_engine):
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([generation("One"), scoring("Two"), scoring("Three")])))
    batch.claim(EngineFactory(stale=True).pk)
    BatchRowFactory(batch=batch, line=1, body=generation("One"))  # the dead engine's first insert

    run_engine_until(start_engine(), batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.COMPLETED
    assert (batch.total, batch.completed, batch.failed) == (3, 3, 0)
    assert sorted(batch.rows.values_list("line", flat=True)) == [1, 2, 3]
    assert custom_ids(lines_of(batch.output_file)) == ["row-1", "row-2", "row-3"]


def test_a_batch_left_cancelling_mid_run_by_a_dead_engine_ends_cancelled(start_engine, resident):
    batch = running_batch([generation("One"), generation("Two"), generation("Three")])
    batch = left_by_a_dead_engine(batch, resident, recorded=1)
    batch.request_cancel()

    run_engine_until(start_engine(), batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.CANCELLED and (batch.completed, batch.failed) == (1, 0)
    assert custom_ids(lines_of(batch.output_file)) == ["row-1"]
    assert [line["error"]["code"] for line in lines_of(batch.error_file)] == ["batch_cancelled"] * 2


def test_a_batch_left_cancelling_while_validating_ends_cancelled_with_nothing_run(start_engine):
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([generation("One"), "not json"])))
    batch.claim(EngineFactory(stale=True).pk)
    BatchRowFactory(batch=batch, line=1, body=generation("One"))
    BatchRowFactory(batch=batch, line=2, custom_id=None, outcome=BatchRow.Outcome.INVALID,
                    error={"code": "invalid_json", "message": "Line 2: the line is not valid JSON"})
    batch.request_cancel()

    run_engine_until(start_engine(), batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.CANCELLED and batch.in_progress_at is None
    assert batch.completed == 0 and batch.output_file is None
    assert batch.rows.get(line=1).outcome == BatchRow.Outcome.PENDING  # never run
    assert [line["error"]["code"] for line in lines_of(batch.error_file)] == ["invalid_json"]


def test_a_resumed_batch_of_a_model_not_resident_waits_and_runs_once_it_is(start_engine, resident):
    other = "tiny-other"
    batch = running_batch([generation("One", other), generation("Two", other), generation("Three", other)], model=other)
    batch = left_by_a_dead_engine(batch, ResidentModel(resident.loaded, model_id=other), recorded=1)
    recorded = batch.rows.get(line=1).request_id

    run_engine_until(start_engine(), batch_is(batch.pk, waiting_reason=Batch.Waiting.MODEL_NOT_RESIDENT))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.IN_PROGRESS and batch.end_status is None
    assert (batch.completed, batch.failed) == (1, 0) and batch.claimed_by is None
    assert batch.rows.unrecorded().count() == 2

    run_engine_until(start_engine(other), batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.COMPLETED and (batch.completed, batch.failed) == (3, 0)
    assert lines_of(batch.output_file)[0]["response"]["request_id"] == recorded


def an_outside_holder_leases_its_model(engine):
    LeaseFactory(model_id=MODEL, engine_id=engine.engine_id)
    return MODEL, Batch.Waiting.LEASE_UNAVAILABLE


def its_model_is_not_resident(engine):
    return "tiny-gone", Batch.Waiting.MODEL_NOT_RESIDENT


@pytest.mark.parametrize("make_it_wait", [an_outside_holder_leases_its_model, its_model_is_not_resident])
def test_a_waiting_batch_past_its_expiry_ends_expired(start_engine, make_it_wait):
    engine = start_engine()
    model, reason = make_it_wait(engine)
    batch = running_batch([generation("One", model), generation("Two", model)], model=model)
    run_engine_until(engine, batch_is(batch.pk, waiting_reason=reason))
    assert batch.rows.unrecorded().count() == 2

    # Its completion window runs out while it waits.
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    run_engine_until(engine, batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.EXPIRED and batch.expired_at
    assert (batch.total, batch.completed, batch.failed) == (2, 0, 0)
    assert lines_of(batch.output_file) == []
    assert [(line["custom_id"], line["error"]["code"]) for line in lines_of(batch.error_file)] == [
        ("row-1", "batch_expired"), ("row-2", "batch_expired")]


def test_an_engine_that_lost_its_claim_can_record_and_assemble_nothing(start_engine, resident):
    batch = running_batch([generation("One"), generation("Two")])
    lost = EngineFactory(model_id=MODEL)
    batch.claim(lost.pk)  # the engine that lost its model's lock keeps this instance, and its token
    stale_rows = list(batch.rows.unrecorded())

    # The engine that took over (its start-up releases the other's claim) runs the batch to its end.
    run_engine_until(start_engine(), batch_is(batch.pk))
    ended = Batch.objects.get(pk=batch.pk)
    rows = list(batch.rows.values_list("line", "request_id", "recorded_at"))
    records, stored = set(File.objects.values_list("pk", flat=True)), sorted(file_storage().listdir("files")[1])

    with pytest.raises(FencedOut):
        run_and_record(batch, resident, stale_rows)
    with pytest.raises(FencedOut):
        assembly.assemble(batch)

    assert list(batch.rows.values_list("line", "request_id", "recorded_at")) == rows
    now = Batch.objects.get(pk=batch.pk)
    assert (now.status, now.completed, now.failed, now.output_file_id) == (
        ended.status, ended.completed, ended.failed, ended.output_file_id)
    # Its assembly's bytes were removed, and no record of them was made.
    assert set(File.objects.values_list("pk", flat=True)) == records
    assert sorted(file_storage().listdir("files")[1]) == stored


def test_a_row_whose_answer_holds_u0000_does_not_jam_its_batch(start_engine):
    nul_token = {"model": MODEL, "prompt": "x", "max_tokens": 1, "allowed_token_ids": [190]}  # 190 is "\x00"
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([generation("One"), nul_token])))

    run_engine_until(start_engine(), batch_is(batch.pk), timeout=10)

    batch = Batch.objects.get(pk=batch.pk)
    assert batch.status == Batch.Status.COMPLETED
    answer = [line for line in lines_of(batch.output_file) if line["custom_id"] == "row-2"][0]
    assert answer["response"]["body"]["choices"][0]["text"] == "\x00"


@pytest.mark.parametrize("batched_decoding", [False, True])
def test_rows_with_sampling_controls_run_as_the_synchronous_route_runs_them(start_engine, resident, batched_decoding):
    # issue 29, point 4: logit_bias and the penalties in batch rows, one at a time and seated
    forced = 1000
    bodies = [generation("Once", max_tokens=4, logit_bias={str(forced): 100}),
              generation("1 2 3 4", max_tokens=8, frequency_penalty=2), generation("1 2 3 4", max_tokens=8),
              generation("Four", max_tokens=4, presence_penalty=-1.5, logit_bias={str(forced): -100})]
    batch = BatchFactory(input_file=FileFactory(lines=requests_of(bodies)), batched_decoding=batched_decoding)
    run_engine_until(start_engine(), batch_is(batch.pk))

    batch.refresh_from_db()
    assert (batch.status, batch.completed) == (Batch.Status.COMPLETED, 4)
    output = lines_of(batch.output_file)
    texts = [line["response"]["body"]["choices"][0]["text"] for line in output]
    assert texts[0] == resident.decode([forced]) * 4
    assert_shared_steps(output, batched_decoding)
    assert texts[1] != texts[2]  # the penalty changed the greedy answer
    synchronous = [services.run(resident, parse_request(COMPLETIONS, body, strict=True)).body["choices"][0]["text"]
                   for body in bodies]
    assert texts == synchronous


@pytest.mark.parametrize("batched_decoding", [False, True])
def test_schema_rows_answer_in_their_schemas_one_at_a_time_and_seated(start_engine, batched_decoding):
    # issue 29, points 1 and 2: each row carries its own grammar state; a plain row beside them
    small = {"type": "object", "properties": {"yes": {"type": "boolean"}, "n": {"type": "integer"}},
             "required": ["yes", "n"], "additionalProperties": False}
    bodies = [generation(f"Pet {seed}:", max_tokens=120, temperature=1.0, seed=seed, response_format=schema_format())
              for seed in range(3)]
    bodies += [generation("Flag:", max_tokens=40, temperature=1.0, seed=4, response_format=schema_format(small)),
               generation("Plain", max_tokens=4)]
    batch = BatchFactory(input_file=FileFactory(lines=requests_of(bodies)), batched_decoding=batched_decoding)
    run_engine_until(start_engine(), batch_is(batch.pk), timeout=60)

    batch.refresh_from_db()
    assert (batch.status, batch.completed) == (Batch.Status.COMPLETED, 5)
    output = lines_of(batch.output_file)
    for line, schema in zip(output, [SCHEMA] * 3 + [small]):
        jsonschema.validate(json.loads(line["response"]["body"]["choices"][0]["text"]), schema)
    assert output[4]["response"]["body"]["choices"][0]["text"]
    assert_shared_steps(output, batched_decoding)


def assert_shared_steps(output, batched_decoding):
    """Seated rows said they shared decode steps (equal answers alone would not show it: in
    float32 a silent fallback to one at a time gives the same answers); serial rows never."""
    shared = [line["response"]["millm"]["batched"] for line in output]
    if batched_decoding:
        assert sum(shared) >= 2, shared
    else:
        assert not any(shared), shared
