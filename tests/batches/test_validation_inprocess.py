"""Validation in-process (SPEC 10, "Validation"): a real engine validates a stored input file,
then runs what is valid; a bad line or a row the model refuses fails alone."""

import re

import pytest

from batches_app import validation
from batches_app.models import Batch, BatchRow, FencedOut
from inference_app.models import Lease
from tests.batches.inprocess import MODEL, batch_is, generation, lines_of, run_engine_until
from tests.factories import BatchFactory, EngineFactory, FileFactory, request_line, requests_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("inprocess_settings")]


def test_a_refused_line_and_a_row_the_model_refuses_fail_alone(start_engine):
    bodies = [
        generation("One"),
        '{"custom_id": "row-2", "method": "POST", "url": "/v1/completions", "body": ',  # cut short
        generation("Three", max_tokens=5000),  # over the context: only the model can tell
        generation("Four"),
    ]
    batch = BatchFactory(input_file=FileFactory(lines=requests_of(bodies)))

    run_engine_until(start_engine(), batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.COMPLETED
    # `failed` counts the invalid line and the row that failed on its own merits (SPEC 10).
    assert (batch.total, batch.completed, batch.failed) == (4, 2, 2)
    assert [(error["code"], error["line"]) for error in batch.errors] == [("invalid_json", 2)]
    assert [line["custom_id"] for line in lines_of(batch.output_file)] == ["row-1", "row-4"]
    refused, failed = lines_of(batch.error_file)
    assert (refused["line"], refused["custom_id"], refused["response"]) == (2, None, None)
    assert refused["error"]["code"] == "invalid_json" and refused["error"]["message"].startswith("Line 2: ")
    assert (failed["line"], failed["custom_id"], failed["error"]["code"]) == (3, "row-3", "context_length_exceeded")
    assert failed["response"]["status_code"] == 400 and failed["error"]["message"].startswith("Line 3: ")
    assert failed["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_a_file_with_no_valid_line_fails_at_validation_with_nothing_run(start_engine):
    batch = BatchFactory(input_file=FileFactory(lines=["not json", request_line(generation("x"), "row-2", "/v1/embeddings")]))

    run_engine_until(start_engine(), batch_is(batch.pk))

    batch.refresh_from_db()
    assert batch.status == Batch.Status.FAILED and batch.failed_at and batch.in_progress_at is None
    assert (batch.total, batch.completed, batch.failed) == (2, 0, 2)
    assert batch.errors[0]["code"] == "empty_file" and batch.errors[0]["line"] is None
    assert batch.output_file is None
    assert [(line["line"], line["error"]["code"]) for line in lines_of(batch.error_file)] == [
        (1, "invalid_json"), (2, "invalid_url")]
    assert not Lease.objects.exists()  # no lease taken


def test_validation_by_an_engine_that_lost_its_claim_writes_nothing(start_engine):
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([generation("One"), generation("Two")])))
    lost = EngineFactory(model_id=MODEL)
    batch.claim(lost.pk)  # the engine that lost its model's lock keeps this instance, and its token

    # The engine that took over validates it (its start-up releases the other's claim) and runs it.
    run_engine_until(start_engine(), batch_is(batch.pk))
    rows = list(BatchRow.objects.filter(batch=batch).values_list("line", "outcome", "request_id"))

    with pytest.raises(FencedOut):
        validation.validate(batch, MODEL)

    assert list(BatchRow.objects.filter(batch=batch).values_list("line", "outcome", "request_id")) == rows
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.COMPLETED


def test_a_schema_the_grammar_cannot_build_fails_its_line_at_validation(start_engine):
    # issue 29: the engine compiles each distinct schema at validation; a bad pattern passes the
    # subset check (it is a string) but not llguidance's regex parser.
    def schema_row(pattern):
        schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}},
                  "required": ["a"], "additionalProperties": False}
        return generation("x", max_tokens=12, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})

    batch = BatchFactory(input_file=FileFactory(lines=requests_of([schema_row("^[ab]{1,3}$"), schema_row("("),
                                                                  schema_row("^[ab]{1,3}$")])))
    run_engine_until(start_engine(), batch_is(batch.pk))

    batch.refresh_from_db()
    assert (batch.status, batch.completed, batch.failed) == (Batch.Status.COMPLETED, 2, 1)
    [error] = batch.errors
    assert (error["code"], error["line"], error["param"]) == ("invalid_request_error", 2, "body.response_format")
    assert "unclosed group" in error["message"]
    texts = [line["response"]["body"]["choices"][0]["text"] for line in lines_of(batch.output_file)]
    assert len(texts) == 2 and all(re.fullmatch(r'\{"a":"[ab]{1,3}"\}', text) for text in texts), texts
