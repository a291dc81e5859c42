"""MILLM_STORAGE=s3 end to end: web and engine keep every file's bytes in an S3 bucket (moto's
standalone server, a process of its own), none under MILLM_DATA_DIR/files. Uploads, a batch
read from the bucket and assembled into it, downloads, deletes and retention, each checked in
the bucket itself with boto3."""

import json
import subprocess

import httpx
import openai
import pytest

from tests.e2e.batch_helpers import line, read_jsonl, start_batch, to_jsonl, wait_for, without_ids
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.faults import leftover_temporaries
from tests.e2e.s3server import s3_server
from tests.e2e.stack import PYTHON, ROOT, Stack
from tests.e2e.test_upload_memory import GROWTH_BOUND_MB, peak_rss_mb, write_batch_file

EMBEDDINGS = "/v1/embeddings"
LOCATION = "millm"  # AWS_LOCATION: the key prefix of every object miServer stores
LARGE_LINES = 24_000  # of 4,194 bytes: a 100 MB file


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(scope="module")
def s3_stack(tmp_path_factory, test_model_dir, s3):
    settings = {**s3.settings(LOCATION), "BATCH_WAIT_POLL_S": 0.2}
    with Stack.running(tmp_path_factory.mktemp("e2e-s3"), test_model_dir, **settings) as stack:
        stack.client = make_client(stack.web.url)
        yield stack


@pytest.fixture(scope="module")
def finished_batch(s3_stack):
    """Three embeddings rows and one invalid line, run to completion from and into the bucket."""
    bodies = [{"model": MODEL_ID, "input": [f"text {i}", "more"], "pooling": "last"} for i in range(3)]
    lines = [line(f"row-{i}", EMBEDDINGS, body) for i, body in enumerate(bodies)]
    lines.append(line("elsewhere", "/v1/elsewhere", bodies[0]))
    batch = start_batch(s3_stack.client, lines, EMBEDDINGS)
    batch = wait_for(s3_stack.client, batch.id, timeout=60)
    assert batch.status == "completed", batch
    return batch, bodies, to_jsonl(lines)


def key(stack, file_id):
    ((storage_name,),) = stack.sql("SELECT storage_name FROM files_app_file WHERE id = %s", [file_id])
    return f"{LOCATION}/{storage_name}"


def manage(stack, *args):
    """A management command in its own process, with the stack's settings (as an operator runs it)."""
    done = subprocess.run([PYTHON, "manage.py", *args], cwd=ROOT, env=stack.env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_an_upload_is_an_object_in_the_bucket_and_nothing_on_disk(s3_stack, s3):
    body = b'{"custom_id": "a", "n": 1}\n{"custom_id": "b", "n": 2}\n'
    created = s3_stack.client.files.create(file=("rows.jsonl", body), purpose="batch")
    assert (created.bytes, created.status) == (len(body), "processed")
    assert key(s3_stack, created.id) == f"{LOCATION}/files/{created.id}.jsonl"
    assert s3.read(key(s3_stack, created.id)) == body
    assert s3_stack.stored_files() == [] and leftover_temporaries(s3_stack) == []
    download = httpx.get(f"{s3_stack.web.url}/v1/files/{created.id}/content", timeout=30)
    assert download.status_code == 200 and download.content == body
    assert download.headers["content-type"] == "application/jsonl"
    assert download.headers["content-length"] == str(len(body))


def test_a_large_upload_and_its_download_pass_through_web_without_it_holding_them(s3_stack, s3, tmp_path):
    """The filesystem's promise (tests/e2e/test_upload_memory.py) on S3: boto3 buffers an upload's
    parts and django-storages spools a download, both within tens of MB."""
    size = write_batch_file(tmp_path / "large.jsonl", lines=LARGE_LINES)
    warm = s3_stack.client.files.create(file=("warm.jsonl", b'{"x": 1}\n'), purpose="batch")
    assert s3_stack.client.files.content(warm.id).content == b'{"x": 1}\n'  # boto3's machinery is not the file
    web = s3_stack.web.popen.pid
    before = peak_rss_mb(web)
    with open(tmp_path / "large.jsonl", "rb") as handle:
        created = httpx.post(s3_stack.web.url + "/v1/files", data={"purpose": "batch"},
                             files={"file": ("large.jsonl", handle)}, timeout=120)
    assert created.status_code == 200, created.text
    file_id = created.json()["id"]
    uploaded = peak_rss_mb(web) - before
    received = 0
    with httpx.stream("GET", f"{s3_stack.web.url}/v1/files/{file_id}/content", timeout=120) as download:
        assert download.status_code == 200 and download.headers["content-length"] == str(size)
        for chunk in download.iter_bytes():
            received += len(chunk)
    assert received == size
    downloaded = peak_rss_mb(web) - before
    print(f"web peak RSS {before:.0f} MB, +{uploaded:.1f} MB after a {size / 1e6:.0f} MB upload, "
          f"+{downloaded:.1f} MB after its download")
    assert downloaded < GROWTH_BOUND_MB, f"web grew {downloaded:.0f} MB passing a {size / 1e6:.0f} MB file"
    s3_stack.client.files.delete(file_id)


def test_a_batch_reads_its_input_from_the_bucket_and_assembles_its_files_into_it(s3_stack, s3, finished_batch):
    batch, bodies, uploaded = finished_batch
    client = s3_stack.client
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    stored = s3.keys(f"{LOCATION}/files/")
    for file_id in (batch.input_file_id, batch.output_file_id, batch.error_file_id):
        assert key(s3_stack, file_id) in stored
    assert s3_stack.stored_files() == [] and leftover_temporaries(s3_stack) == []

    assert client.files.content(batch.input_file_id).content == uploaded
    output_bytes = client.files.content(batch.output_file_id).content
    assert output_bytes == s3.read(key(s3_stack, batch.output_file_id))
    output = [json.loads(row) for row in output_bytes.decode().splitlines()]
    assert [row["custom_id"] for row in output] == ["row-0", "row-1", "row-2"]
    for row, body in zip(output, bodies):
        sync = httpx.post(s3_stack.web.url + EMBEDDINGS, json=body, timeout=60)
        assert without_ids(row["response"]["body"]) == without_ids(sync.json())
    [invalid] = read_jsonl(client, batch.error_file_id)
    assert (invalid["custom_id"], invalid["error"]["code"]) == ("elsewhere", "invalid_url")
    assert json.loads(s3.read(key(s3_stack, batch.error_file_id))) == invalid


def test_a_deleted_file_is_gone_from_the_bucket(s3_stack, s3):
    created = s3_stack.client.files.create(file=("gone.jsonl", b'{"x": 1}\n'), purpose="batch")
    stored = key(s3_stack, created.id)
    assert stored in s3.keys(f"{LOCATION}/files/")
    assert s3_stack.client.files.delete(created.id).deleted is True
    assert stored not in s3.keys(f"{LOCATION}/files/")
    with pytest.raises(openai.NotFoundError) as caught:
        s3_stack.client.files.content(created.id)
    assert caught.value.code == "file_not_found"


def test_a_record_whose_object_is_missing_or_outside_the_location_answers_404(s3_stack, s3):
    lost = s3_stack.client.files.create(file=("lost.jsonl", b'{"x": 1}\n'), purpose="batch")
    s3.client().delete_object(Bucket=s3.bucket, Key=key(s3_stack, lost.id))  # behind the server's back
    tampered = s3_stack.client.files.create(file=("tampered.jsonl", b'{"x": 2}\n'), purpose="batch")
    s3_stack.sql("UPDATE files_app_file SET storage_name = %s WHERE id = %s RETURNING id",
                 ["../../outside.jsonl", tampered.id])
    for file_id in (lost.id, tampered.id):
        answer = httpx.get(f"{s3_stack.web.url}/v1/files/{file_id}/content", timeout=30)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "file_not_found"
    s3_stack.sql("UPDATE files_app_file SET storage_name = %s WHERE id = %s RETURNING id",
                 [f"files/{tampered.id}.jsonl", tampered.id])  # its object is no orphan for the sweep below
    assert s3_stack.client.files.content(tampered.id).content == b'{"x": 2}\n'


def test_prune_expires_files_in_the_bucket_and_sweeps_old_orphans(s3_stack, s3, finished_batch):
    batch, _, _ = finished_batch
    file_ids = [batch.input_file_id, batch.output_file_id, batch.error_file_id]
    keys = [key(s3_stack, file_id) for file_id in file_ids]
    kept = s3_stack.client.files.create(file=("kept.jsonl", b'{"kept": 1}\n'), purpose="batch")
    orphan = f"{LOCATION}/files/file-orphan-by-a-crash.jsonl"
    s3.client().put_object(Bucket=s3.bucket, Key=orphan, Body=b'{"orphan": 1}\n')
    s3_stack.sql("UPDATE files_app_file SET expires_at = now() - interval '1 minute' WHERE id = ANY(%s) RETURNING id",
                 [file_ids])

    said = manage(s3_stack, "prune")
    assert said.startswith("expired 3 file(s), swept 0 orphan(s)"), said
    stored = s3.keys(f"{LOCATION}/")
    assert [name for name in keys if name in stored] == []
    assert key(s3_stack, kept.id) in stored and orphan in stored  # the orphan is younger than its grace
    statuses = s3_stack.sql("SELECT status FROM files_app_file WHERE id = ANY(%s)", [file_ids])
    assert sorted(status for (status,) in statuses) == ["expired"] * 3
    with pytest.raises(openai.NotFoundError) as caught:
        s3_stack.client.files.content(batch.output_file_id)
    assert caught.value.code == "file_expired"

    # Two hours on, the sweep lists the prefix, reads the orphan's age from the bucket and removes it.
    swept = manage(s3_stack, "shell", "-v", "0", "-c", (
        "from datetime import timedelta; from django.utils import timezone; "
        "from files_app.retention import sweep_orphans; "
        "print(sweep_orphans(timezone.now() + timedelta(hours=2)))"
    ))
    assert swept.strip() == str(["files/file-orphan-by-a-crash.jsonl"])
    stored = s3.keys(f"{LOCATION}/")
    assert orphan not in stored and key(s3_stack, kept.id) in stored
