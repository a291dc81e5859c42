"""Quotas per project (issue 18, point 3): over active batches, queued rows or stored file bytes
the create is a 429 quota_exceeded naming the quota, its limit and the use, and stores nothing;
a batch that ends and a file deleted or expired free their share at once; two racing creates of
one project cannot both pass. The use shows in the admin and on /metrics."""

import re
import threading
import time
from datetime import datetime, timedelta, timezone

import httpx
import openai
import pytest
import time_machine
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, connection, connections, transaction
from django.test import Client

from batches_app.models import Batch
from batches_app.usage import usage
from files_app.models import File, IdempotencyKey
from files_app.uploads import BatchFileUploadHandler
from millm_lib import metrics
from projects_app.admin import ProjectAdmin
from projects_app.models import Project
from tests.factories import jsonl
from tests.projects.calls import Caller, end_batch, lines, stored_names

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("inprocess_settings")]

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
def team_a(client):
    return Caller.of_project(client, "team-a")


@pytest.fixture
def team_b(client):
    return Caller.of_project(client, "team-b")


def everything_stored():
    return {"files": sorted(File.objects.values_list("pk", "status")),
            "batches": sorted(Batch.objects.values_list("pk", flat=True)),
            "keys": IdempotencyKey.objects.count(), "bytes": stored_names()}


def assert_quota_refusal(response, quota, limit, current):
    assert response.status_code == 429, response.content
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("quota_exceeded", "rate_limit_error")
    assert error["details"] == {"quota": quota, "limit": limit, "current": current}
    assert quota in error["message"] and f"{limit:,}" in error["message"]


def test_over_the_active_batches_quota_a_batch_is_refused_until_one_ends(settings, team_a, team_b):
    settings.MILLM_QUOTA_ACTIVE_BATCHES = 1
    running = team_a.batch()
    second_file = team_a.file()
    before = everything_stored()

    refused = team_a.create_batch(second_file, HTTP_IDEMPOTENCY_KEY="retry-me")

    assert_quota_refusal(refused, "active_batches", 1, 1)
    assert everything_stored() == before  # no batch, no Idempotency-Key
    assert team_b.batch()  # another project's use is its own

    end_batch(running)
    assert usage(team_a.project)["active_batches"] == 0
    assert team_a.create_batch(second_file, HTTP_IDEMPOTENCY_KEY="retry-me").status_code == 200


def test_a_projects_own_limit_overrides_the_setting(settings, team_a):
    settings.MILLM_QUOTA_ACTIVE_BATCHES = 1
    Project.objects.filter(pk=team_a.project.pk).update(max_active_batches=2)
    team_a.batch()
    team_a.batch()
    assert_quota_refusal(team_a.create_batch(team_a.file()), "active_batches", 2, 2)


def test_over_the_queued_rows_quota_a_batch_is_refused_until_rows_run_or_its_batch_ends(settings, team_a):
    settings.MILLM_QUOTA_QUEUED_ROWS = 5
    first = team_a.batch(rows=3)  # validating: its file's 3 lines count
    three_more = team_a.file(rows=3)
    before = everything_stored()

    assert_quota_refusal(team_a.create_batch(three_more), "queued_rows", 5, 3)
    assert everything_stored() == before

    # Validated and two rows run: 1 row left (a test's shortcut, not a runner's write).
    Batch.objects.filter(pk=first).update(status=Batch.Status.IN_PROGRESS, total=3, completed=1, failed=1)
    assert usage(team_a.project)["queued_rows"] == 1
    second = team_a.create_batch(three_more)
    assert second.status_code == 200
    assert_quota_refusal(team_a.create_batch(team_a.file(rows=2)), "queued_rows", 5, 4)

    end_batch(first)
    assert usage(team_a.project)["queued_rows"] == 3
    assert team_a.create_batch(team_a.file(rows=2)).status_code == 200


def test_over_the_file_bytes_quota_an_upload_stores_nothing_until_a_file_is_deleted(settings, team_a, team_b):
    first = jsonl(lines(2))
    settings.MILLM_QUOTA_FILE_BYTES = len(first) + 10
    kept = team_a.upload(body=first).json()["id"]
    before = everything_stored()

    refused = team_a.upload(body=jsonl(lines(1)), HTTP_IDEMPOTENCY_KEY="retry-me")

    assert_quota_refusal(refused, "file_bytes", len(first) + 10, len(first))
    assert everything_stored() == before  # no record, no bytes, no Idempotency-Key
    assert team_b.upload(body=first).status_code == 200  # another project's use is its own

    assert team_a.delete(f"/v1/files/{kept}").status_code == 200
    assert usage(team_a.project)["file_bytes"] == 0
    assert team_a.upload(body=jsonl(lines(1)), HTTP_IDEMPOTENCY_KEY="retry-me").status_code == 200


def test_an_expired_file_frees_its_bytes_at_once(settings, team_a):
    body = jsonl(lines(2))
    settings.MILLM_QUOTA_FILE_BYTES = len(body)
    with time_machine.travel(T0, tick=False):
        assert team_a.upload(body=body).status_code == 200
        assert team_a.upload(body=body).status_code == 429
    with time_machine.travel(T0 + timedelta(days=30), tick=False):  # expired, not yet pruned
        assert usage(team_a.project)["file_bytes"] == 0
        assert team_a.upload(body=body).status_code == 200


def test_a_batchs_output_and_error_files_count_as_its_projects_bytes(team_a):
    batch = team_a.batch(rows=2)
    ended = end_batch(batch)
    outputs = sum(file.bytes for file in (ended.output_file, ended.error_file) if file is not None)
    input_bytes = File.objects.get(pk=ended.input_file_id).bytes
    assert usage(team_a.project)["file_bytes"] == input_bytes + outputs


def test_a_declared_body_over_the_quota_is_refused_before_it_is_read(settings, team_a, monkeypatch):
    settings.MILLM_QUOTA_FILE_BYTES = 1000
    read = []
    monkeypatch.setattr(BatchFileUploadHandler, "receive_data_chunk", lambda self, chunk, start: read.append(len(chunk)))
    big = jsonl([{"custom_id": f"row-{n}", "pad": "x" * 1000} for n in range(1500)])  # about 1.5 MB

    refused = team_a.upload(body=big)

    assert_quota_refusal(refused, "file_bytes", 1000, 0)
    assert read == [] and everything_stored()["files"] == []


def test_the_sdk_raises_rate_limit_error(settings, team_a):
    settings.MILLM_QUOTA_FILE_BYTES = 10
    http = httpx.Client(transport=httpx.WSGITransport(app=WSGIHandler()))
    client = openai.OpenAI(api_key=team_a.key, base_url="http://testserver/v1", http_client=http, max_retries=0)
    # As the test client does: the request's end must not close the test's connection (its transaction).
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            client.files.create(file=("rows.jsonl", jsonl(lines(1))), purpose="batch")
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)
    assert refused.value.code == "quota_exceeded"
    assert refused.value.body["details"] == {"quota": "file_bytes", "limit": 10, "current": 0}


def test_the_admin_and_metrics_show_each_projects_use(settings, team_a, team_b):
    settings.MILLM_QUOTA_ACTIVE_BATCHES = 3
    team_a.batch(rows=2)
    used = usage(team_a.project)
    assert used["active_batches"] == 1 and used["queued_rows"] == 2 and used["file_bytes"] > 0

    shown = ProjectAdmin(Project, None).use(team_a.project)
    assert "active_batches 1 (3)" in shown and "queued_rows 2 (no limit)" in shown

    text = metrics.render().decode()
    series = dict(re.findall(r'^millm_project_usage\{(.*)\} (\S+)$', text, re.M))
    assert float(series['project="team-a",quota="active_batches"']) == 1
    assert float(series['project="team-a",quota="queued_rows"']) == 2
    assert float(series['project="team-a",quota="file_bytes"']) == used["file_bytes"]
    assert float(series['project="team-b",quota="active_batches"']) == 0


# --- the race: two creates of one project, each within the quota alone ---


def waiting_on_locks(count, timeout=10):
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # a transaction sees one snapshot otherwise
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock'")
            if cursor.fetchone()[0] >= count:
                return
            time.sleep(0.02)
    raise AssertionError(f"{count} requests never waited on the project's lock")


def racing(caller, project, calls):
    """Each of `calls` (a function of a Caller) in a thread of its own, started while the test
    holds the project's row lock, so that each passes every check made without it and then
    waits; the lock is released once all wait. Returns their responses."""
    responses = [None] * len(calls)

    def run(index, call):
        try:
            responses[index] = call(Caller(Client(), caller.key))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(index, call)) for index, call in enumerate(calls)]
    with transaction.atomic():
        Project.objects.select_for_update().get(pk=project.pk)
        for thread in threads:
            thread.start()
        waiting_on_locks(len(threads))
    for thread in threads:
        thread.join(30)
    return responses


@pytest.mark.django_db(transaction=True)
def test_two_racing_uploads_cannot_both_pass_and_the_refused_ones_bytes_go(settings, team_a):
    body = jsonl(lines(2))
    settings.MILLM_QUOTA_FILE_BYTES = len(body) * 3 // 2

    responses = racing(team_a, team_a.project, [lambda caller: caller.upload(body=body)] * 2)

    assert sorted(response.status_code for response in responses) == [200, 429]
    refused = next(response for response in responses if response.status_code == 429)
    assert refused.json()["error"]["details"]["current"] == len(body)
    assert [file.storage_name for file in File.objects.all()] == stored_names()  # no orphan bytes
    assert File.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_racing_batches_cannot_both_pass(settings, team_a):
    settings.MILLM_QUOTA_ACTIVE_BATCHES = 1
    files = [team_a.file(), team_a.file()]

    responses = racing(team_a, team_a.project, [lambda caller, file=file: caller.create_batch(file) for file in files])

    assert sorted(response.status_code for response in responses) == [200, 429]
    assert Batch.objects.count() == 1
