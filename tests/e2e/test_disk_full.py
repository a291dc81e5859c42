"""A full disk (SPEC 9, 10): MILLM_DATA_DIR on a small tmpfs that the test fills up.

While the disk is full, a batch whose rows have all run stays `finalizing` and assembly is tried
again and again; nothing half-written is stored or served, nothing is lost; uploads are refused
with 507 `insufficient_storage` (with Retry-After) and store nothing. Once space is freed, the
batch completes with every line once.
"""

import io
import time
from collections import Counter

import httpx
import openai
import pytest

from tests.e2e.batch_helpers import read_jsonl, start_batch, to_jsonl, wait_for
from tests.e2e.conftest import make_client
from tests.e2e.faults import COMPLETIONS, fill, leftover_temporaries, orphans, scoring_lines, small_disk
from tests.e2e.stack import Stack, wait_until

ROWS = 64
DISK_BYTES = 16 * 1024 * 1024


@pytest.fixture
def full_disk_stack(tmp_path, test_model_dir):
    try:
        with small_disk(tmp_path / "disk", DISK_BYTES) as disk:
            settings = {"MILLM_DATA_DIR": disk, "BATCH_WAIT_POLL_S": 0.2, "BATCH_TEST_PAUSE_BEFORE_RECORD_S": 0.05}
            (tmp_path / "work").mkdir()
            with Stack.running(tmp_path / "work", test_model_dir, **settings) as stack:
                stack.disk = disk
                stack.client = make_client(stack.web.url)
                yield stack
    except PermissionError as error:
        pytest.skip(f"no small filesystem to fill: {error}")


def upload(stack, content):
    return httpx.post(stack.web.url + "/v1/files", data={"purpose": "batch"},
                      files={"file": ("input.jsonl", content, "application/jsonl")}, timeout=30)


def test_a_full_disk_keeps_the_batch_finalizing_and_refuses_uploads_until_space_returns(full_disk_stack):
    stack, client = full_disk_stack, full_disk_stack.client
    batch = start_batch(client, scoring_lines(ROWS), COMPLETIONS)
    wait_for(client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 8)
    stored_before = stack.stored_files()
    assert len(stored_before) == 1  # the input file
    filler = fill(stack.disk)

    # The rows keep running (they live in PostgreSQL); writing the files fails, again and again.
    wait_for(client, batch.id, {"finalizing"}, timeout=60)
    failures_at = stack.engine.log().count("No space left on device")
    time.sleep(1.5)
    stuck = client.batches.retrieve(batch.id)
    assert stuck.status == "finalizing" and stuck.output_file_id is None and stuck.error_file_id is None
    assert stuck.request_counts.completed == ROWS
    retries = stack.engine.log().count("No space left on device") - failures_at
    assert retries >= 2, "assembly was not tried again"
    # Nothing half-written is stored, listed or served.
    assert stack.stored_files() == stored_before
    assert [f.id for f in client.files.list()] == [batch.input_file_id]

    # Uploads on the full disk: 507 insufficient_storage, nothing stored, no temporary left.
    for content in (to_jsonl(scoring_lines(3)), to_jsonl(scoring_lines(6000))):  # one buffered, one streamed
        refused = upload(stack, content)
        assert refused.status_code == 507, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["type"]) == ("insufficient_storage", "server_error")
        assert "full" in error["message"] and "MILLM_DATA_DIR" in error["message"]
        assert int(refused.headers["Retry-After"]) >= 1
    with pytest.raises(openai.InternalServerError) as caught:
        client.files.create(file=("input.jsonl", io.BytesIO(to_jsonl(scoring_lines(3)))), purpose="batch")
    assert caught.value.status_code == 507
    assert stack.stored_files() == stored_before
    wait_until(lambda: leftover_temporaries(stack) == [], 10, f"temporaries left: {leftover_temporaries(stack)}")
    assert client.batches.retrieve(batch.id).status == "finalizing"

    # Space returns: the batch completes by itself, each line once, in order; the disk is clean.
    filler.unlink()
    done = wait_for(client, batch.id, timeout=60)
    assert done.status == "completed" and done.finalizing_at <= done.completed_at
    output, errors = read_jsonl(client, done.output_file_id), read_jsonl(client, done.error_file_id)
    assert errors == [] and done.error_file_id is None
    assert [row["custom_id"] for row in output] == [f"row-{i}" for i in range(ROWS)]
    assert Counter(row["response"]["status_code"] for row in output) == {200: ROWS}
    assert client.files.retrieve(done.output_file_id).bytes == len(client.files.content(done.output_file_id).content)
    assert orphans(stack) == ([], [])
    assert leftover_temporaries(stack) == []
    assert len(stack.stored_files()) == 2
    assert upload(stack, to_jsonl(scoring_lines(3))).status_code == 200  # uploads work again
