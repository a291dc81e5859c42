"""Stored responses on the real database: kept with their size and expiry, owned by a project,
purged after RESPONSES_RETENTION_DAYS, and counted in the project's stored bytes."""

import json
import time
from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches_app.retention import run_retention
from files_app.models import File
from inference_app.schemas import parse_request
from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from millm_lib.limits import RESPONSES
from projects_app.models import Project, stored_bytes
from responses_app.answers import from_chat
from responses_app.models import StoredResponse, responses_stored_bytes

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def storage_in_tmp(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}


def answer_and_items(text="Hello there.", question="hi"):
    asked = parse_request(RESPONSES, {"model": "m", "input": question}, strict=True).request
    chat = {"model": "m", "choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    return json.loads(json.dumps(from_chat(asked, new_id("resp_"), chat, int(time.time())))), asked.input_items()


def kept(project, **answer):
    body, items = answer_and_items(**answer)
    return StoredResponse.keep(body, items, project)


def test_keep_stores_the_size_and_the_expiry(settings):
    settings.RESPONSES_RETENTION_DAYS = 7
    body, items = answer_and_items()
    before = timezone.now()
    stored = StoredResponse.keep(body, items, Project.objects.named("a"))
    again = StoredResponse.objects.get(pk=body["id"])
    assert again.bytes == stored.bytes > 0
    assert again.bytes == len(json.dumps(body)) + len(json.dumps(items))
    assert again.status == "completed" and again.body == body and again.input_items == items
    assert again.expires_at - again.created_at == timedelta(days=7)
    assert before <= again.created_at <= timezone.now()
    larger = kept(Project.objects.named("a"), text="x" * 1000)
    assert larger.bytes > stored.bytes + 900


def test_found_is_the_owners_and_404_for_another_project():
    owner, other = Project.objects.named("a"), Project.objects.named("b")
    stored = kept(owner)
    assert StoredResponse.objects.found(stored.pk, owner).pk == stored.pk
    for asking, response_id in [(other, stored.pk), (owner, "resp_missing")]:
        with pytest.raises(ApiError) as caught:
            StoredResponse.objects.found(response_id, asking)
        assert (caught.value.status, caught.value.code) == (404, "response_not_found")
        assert response_id in caught.value.message
    admin = Project.objects.named("root", admin=True)
    assert StoredResponse.objects.found(stored.pk, admin).pk == stored.pk  # an admin project sees all
    assert StoredResponse.objects.found(stored.pk, None).pk == stored.pk  # as the engine does


def test_the_conversation_is_the_input_items_then_the_output():
    stored = kept(Project.objects.named("a"), text="answer", question="question")
    conversation = StoredResponse.objects.get(pk=stored.pk).conversation()
    assert [(item["type"], item["role"]) for item in conversation] == [("message", "user"), ("message", "assistant")]
    assert conversation[0]["content"][0]["text"] == "question" and conversation[1]["content"][0]["text"] == "answer"
    assert conversation == [*stored.input_items, *stored.body["output"]]


def test_purge_expired_deletes_only_expired_responses():
    project = Project.objects.named("a")
    now = timezone.now()
    old, due, fresh = kept(project), kept(project), kept(project)
    StoredResponse.objects.filter(pk=old.pk).update(expires_at=now - timedelta(days=1))
    StoredResponse.objects.filter(pk=due.pk).update(expires_at=now)
    assert StoredResponse.objects.purge_expired(now) == 2
    assert list(StoredResponse.objects.values_list("pk", flat=True)) == [fresh.pk]
    assert StoredResponse.objects.purge_expired(now) == 0
    assert StoredResponse.objects.purge_expired(fresh.expires_at + timedelta(seconds=1)) == 1
    assert not StoredResponse.objects.exists()


def test_stored_bytes_count_files_and_responses():
    project, other = Project.objects.named("a"), Project.objects.named("b")
    assert stored_bytes([project.pk, other.pk]) == {project.pk: 0, other.pk: 0}
    upload = SimpleUploadedFile("in.jsonl", b'{"a": 1}\n' * 10)
    upload.line_count = 10
    file, _ = File.record(upload, File.Purpose.BATCH, 3600, project=project)
    responses = [kept(project), kept(project, text="longer " * 20), kept(other)]
    mine = responses[0].bytes + responses[1].bytes
    assert responses_stored_bytes([project.pk, other.pk]) == {project.pk: mine, other.pk: responses[2].bytes}
    assert StoredResponse.objects.filter(project=project).stored_bytes() == mine
    assert stored_bytes([project.pk, other.pk]) == {project.pk: file.bytes + mine, other.pk: responses[2].bytes}
    responses[1].delete()
    assert stored_bytes([project.pk])[project.pk] == file.bytes + responses[0].bytes


def test_retention_purges_expired_responses():
    project = Project.objects.named("a")
    expired, fresh = kept(project), kept(project)
    StoredResponse.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    outcome = run_retention()
    assert outcome["responses_deleted"] == 1
    assert list(StoredResponse.objects.values_list("pk", flat=True)) == [fresh.pk]
    assert run_retention()["responses_deleted"] == 0
