"""The Batch API end to end: the openai client in strict validation against real processes."""

import httpx
import openai
import pytest

from tests.e2e.batch_helpers import (CHAT, COMPLETIONS, EMBEDDINGS, PROBES, bodies, line, provenance, read_jsonl,
                                     start_batch, to_jsonl, wait_for, without_ids)
from tests.e2e.conftest import MODEL_ID
from tests.e2e.test_probes import probe_body


@pytest.fixture(scope="module")
def probe_for_batches(stack):
    created = httpx.post(stack.web.url + "/api/probes", json=probe_body(name="batch-probe")).json()["data"]
    yield created
    httpx.delete(stack.web.url + f"/api/probes/{created['id']}")


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, EMBEDDINGS, PROBES])
def test_each_output_line_equals_the_synchronous_answer(stack, client, endpoint, probe_for_batches):
    requests = bodies(endpoint, 5)
    lines = [line(f"row-{i}", endpoint, body) for i, body in enumerate(requests)]
    lines.append(line("elsewhere", "/v1/elsewhere", requests[0]))  # one invalid line: an error file too
    batch = start_batch(client, lines, endpoint, metadata={"purpose": "e2e"})
    assert batch.status == "validating" and batch.metadata == {"purpose": "e2e"}
    batch = wait_for(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 6 and batch.request_counts.completed == 5 and batch.request_counts.failed == 1
    assert batch.model == MODEL_ID
    [invalid] = read_jsonl(client, batch.error_file_id)
    assert (invalid["custom_id"], invalid["line"], invalid["error"]["code"]) == ("elsewhere", 6, "invalid_url")
    output = read_jsonl(client, batch.output_file_id)
    assert [row["custom_id"] for row in output] == [f"row-{i}" for i in range(5)]
    for row, body in zip(output, requests):
        sync = httpx.post(stack.web.url + endpoint, json=body, timeout=60)
        assert sync.status_code == 200
        response = row["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        assert row["id"].startswith("batch_req_") and row["error"] is None
        if endpoint == PROBES:
            assert response["body"] == sync.json()
        else:
            assert without_ids(response["body"]) == without_ids(sync.json())
        assert response["millm"]["packed"] is False
        assert provenance(response["millm"]["headers"]) == provenance(sync.headers)
    if endpoint != PROBES:
        assert batch.usage.input_tokens == sum(r["response"]["body"]["usage"]["prompt_tokens"] for r in output)
    assert batch.id in [item.id for item in client.batches.list(limit=2)]  # auto-paging
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_invalid_lines_go_to_the_error_file_with_their_line_numbers(client):
    good = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1, "logprobs": 1}
    lines = [
        line("ok-1", COMPLETIONS, good),
        "",  # blank
        "{not json",
        '["an", "array"]',
        line("", COMPLETIONS, good),  # empty custom_id
        line("ok-1", COMPLETIONS, good),  # duplicate of a valid line
        line("get", COMPLETIONS, good, method="GET"),
        line("url", CHAT, good),
        {"custom_id": "body", "method": "POST", "url": COMPLETIONS, "body": "text"},
        line("stream", COMPLETIONS, {**good, "stream": True}),
        line("schema", COMPLETIONS, {**good, "temperature": 9}),
        line("unused", COMPLETIONS, {**good, "user": "someone"}),
        line("honour", COMPLETIONS, {**good, "echo": True}),
        line("model", COMPLETIONS, {**good, "model": "tiny"}),
        line("ok-2", COMPLETIONS, good),
    ]
    batch = wait_for(client, start_batch(client, lines, COMPLETIONS).id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (15, 2, 13)
    errors = {row["line"]: row for row in read_jsonl(client, batch.error_file_id)}
    expected = {2: "invalid_json", 3: "invalid_json", 4: "invalid_line", 5: "invalid_custom_id", 6: "duplicate_custom_id",
                7: "invalid_method", 8: "invalid_url", 9: "invalid_body", 10: "stream_not_supported",
                11: "invalid_parameter", 12: "unused_fields_refused", 13: "field_not_honoured", 14: "model_not_found"}
    assert {number: row["error"]["code"] for number, row in errors.items()} == expected
    assert all(row["error"]["message"].startswith(f"Line {number}: ") for number, row in errors.items())
    assert all(row["response"] is None for row in errors.values())
    assert errors[11]["error"]["message"] == "Line 11: Invalid value for 'body.temperature': Input should be less than or equal to 2"
    assert errors[14]["error"]["message"] == "Line 14: The model 'tiny' does not exist. GET /v1/models lists the models served here."
    assert errors[3]["custom_id"] is None and errors[7]["custom_id"] == "get"
    assert [row["custom_id"] for row in read_jsonl(client, batch.output_file_id)] == ["ok-1", "ok-2"]
    assert [error.line for error in batch.errors.data] == sorted(expected)


def test_a_row_too_long_for_the_context_fails_alone(client):
    lines = [line("short", COMPLETIONS, {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}),
             line("long", COMPLETIONS, {"model": MODEL_ID, "prompt": "word " * 1100, "max_tokens": 2}),
             line("after", COMPLETIONS, {"model": MODEL_ID, "prompt": "bye", "max_tokens": 2})]
    batch = wait_for(client, start_batch(client, lines, COMPLETIONS).id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    [failed] = read_jsonl(client, batch.error_file_id)
    assert failed["custom_id"] == "long" and failed["line"] == 2
    assert failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert failed["error"]["code"] == "context_length_exceeded"


def test_a_batch_with_no_valid_line_fails_as_empty_file(client):
    batch = wait_for(client, start_batch(client, ["{}", "nope"], COMPLETIONS).id)
    assert batch.status == "failed"
    assert batch.errors.data[0].code == "empty_file" and batch.errors.data[0].line is None
    assert batch.output_file_id is None
    assert [row["line"] for row in read_jsonl(client, batch.error_file_id)] == [1, 2]


def test_valid_lines_naming_two_models_fail_the_batch(stack, client):
    registered = httpx.post(stack.web.url + "/api/models", json={"source": str(stack.model_dir), "id": "tiny-elsewhere"})
    assert registered.status_code in (201, 409)
    lines = [line("a", COMPLETIONS, {"model": MODEL_ID, "prompt": "x"}),
             line("b", COMPLETIONS, {"model": "tiny-elsewhere", "prompt": "x"}),
             line("c", COMPLETIONS, {"model": "tiny-elsewhere", "prompt": "y"})]
    batch = wait_for(client, start_batch(client, lines, COMPLETIONS).id)
    assert batch.status == "failed"
    error = batch.errors.data[0]
    assert error.code == "multiple_models"
    assert "'tiny-elsewhere' (2 lines)" in error.message and f"'{MODEL_ID}' (1 lines)" in error.message
    assert batch.error_file_id is None and batch.output_file_id is None  # no invalid line, nothing ran


def test_a_batch_for_a_model_that_is_not_resident_fails_and_loads_nothing(stack, client):
    httpx.post(stack.web.url + "/api/models", json={"source": str(stack.model_dir), "id": "tiny-elsewhere"})
    lines = [line("a", COMPLETIONS, {"model": "tiny-elsewhere", "prompt": "x"})]
    batch = wait_for(client, start_batch(client, lines, COMPLETIONS).id)
    assert batch.status == "failed" and batch.errors.data[0].code == "model_not_resident"
    assert f"'{MODEL_ID}'" in batch.errors.data[0].message
    assert httpx.get(stack.web.url + "/api/health/detailed").json()["model_name"] == MODEL_ID
    assert "loaded tiny-elsewhere" not in stack.engine.log()


def test_cancel_after_the_end_is_409_naming_the_status(client):
    lines = [line("a", COMPLETIONS, {"model": MODEL_ID, "prompt": "x", "max_tokens": 1})]
    batch = wait_for(client, start_batch(client, lines, COMPLETIONS).id)
    with pytest.raises(openai.ConflictError) as caught:
        client.batches.cancel(batch.id)
    assert caught.value.code == "batch_state_conflict" and "completed" in caught.value.message


def test_the_input_file_of_an_unfinished_batch_cannot_be_deleted(stack, client):
    slow = [line(f"g{i}", CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": "go"}], "max_tokens": 200,
                                 "temperature": 0}) for i in range(6)]
    batch = start_batch(client, slow, CHAT)
    with pytest.raises(openai.ConflictError) as caught:
        client.files.delete(batch.input_file_id)
    assert caught.value.code == "file_in_use" and batch.id in caught.value.message
    client.batches.cancel(batch.id)
    ended = wait_for(client, batch.id)
    assert ended.status == "cancelled"
    assert client.files.delete(batch.input_file_id).deleted is True


def test_create_refusals_name_their_field(stack, client):
    uploaded = client.files.create(file=("x.jsonl", to_jsonl([line("a", COMPLETIONS, {"model": MODEL_ID, "prompt": "x"})])), purpose="batch")
    cases = [
        ({"input_file_id": "file-none", "endpoint": COMPLETIONS, "completion_window": "24h"}, 404, "file_not_found", "input_file_id"),
        ({"input_file_id": uploaded.id, "endpoint": "/v1/images/generations", "completion_window": "24h"}, 400, "invalid_batch_request", "endpoint"),
        ({"input_file_id": uploaded.id, "endpoint": COMPLETIONS, "completion_window": "169h"}, 400, "invalid_batch_request", "completion_window"),
        ({"input_file_id": uploaded.id, "endpoint": COMPLETIONS, "completion_window": "0h"}, 400, "invalid_batch_request", "completion_window"),
        ({"input_file_id": uploaded.id, "endpoint": COMPLETIONS, "completion_window": "24h", "metadata": {"k": 5}}, 400, "invalid_batch_request", "metadata"),
        ({"input_file_id": uploaded.id, "endpoint": COMPLETIONS, "completion_window": "24h",
          "output_expires_after": {"anchor": "created_at", "seconds": 10}}, 400, "invalid_batch_request", "output_expires_after.seconds"),
        ({"input_file_id": uploaded.id, "endpoint": COMPLETIONS, "completion_window": "24h", "pack_window": 5000}, 400, "invalid_batch_request", "pack_window"),
    ]
    for body, status, code, param in cases:
        response = httpx.post(stack.web.url + "/v1/batches", json=body)
        assert response.status_code == status, (body, response.text)
        assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (code, param)
    unknown = httpx.post(stack.web.url + "/v1/batches", json={"input_file_id": uploaded.id, "endpoint": COMPLETIONS,
                                                               "completion_window": "24h"}, headers={"X-miLLM-Lease": "lease_" + "0" * 40})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "lease_not_found"


def test_the_same_idempotency_key_answers_the_first_batch(client):
    uploaded = client.files.create(file=("x.jsonl", to_jsonl([line("a", COMPLETIONS, {"model": MODEL_ID, "prompt": "x", "max_tokens": 1})])), purpose="batch")
    headers = {"Idempotency-Key": "batch-once-7"}
    first = client.batches.create(input_file_id=uploaded.id, endpoint=COMPLETIONS, completion_window="24h", extra_headers=headers)
    second = client.batches.create(input_file_id=uploaded.id, endpoint=COMPLETIONS, completion_window="24h", extra_headers=headers)
    assert second.id == first.id
    wait_for(client, first.id)
