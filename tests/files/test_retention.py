"""Expiry and the pruner, on the real database, with a frozen clock."""

import os
from datetime import datetime, timedelta, timezone

import pytest
import time_machine
from django.core.files.uploadedfile import SimpleUploadedFile

from files_app.models import File, file_storage
from files_app.retention import prune_files, sweep_orphans

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture(autouse=True)
def storage_in_tmp(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)


def upload(client, body=b'{"a": 1}\n', **fields):
    return client.post("/v1/files", {"purpose": "batch", "file": SimpleUploadedFile("rows.jsonl", body), **fields})


@pytest.mark.django_db
def test_a_file_expires_after_its_retention_and_keeps_its_record(client):
    with time_machine.travel(T0, tick=False):
        created = upload(client).json()
    file = File.objects.get(pk=created["id"])
    assert created["expires_at"] == int((T0 + timedelta(days=30)).timestamp())

    with time_machine.travel(T0 + timedelta(days=30, seconds=-1), tick=False):
        assert prune_files() == []
        assert client.get(f"/v1/files/{file.pk}/content").status_code == 200

    with time_machine.travel(T0 + timedelta(days=30), tick=False):
        assert prune_files() == [file.pk]
        content = client.get(f"/v1/files/{file.pk}/content")
        assert content.status_code == 404 and content.json()["error"]["code"] == "file_expired"
        record = client.get(f"/v1/files/{file.pk}").json()
    assert record["status"] == "processed"
    assert "expired at 2026-03-31T12:00:00Z" in record["status_details"]
    assert not file_storage().exists(file.storage_name)
    assert File.objects.get(pk=file.pk).status == "expired"


@pytest.mark.django_db
def test_expires_after_anchors_at_creation(client):
    with time_machine.travel(T0, tick=False):
        created = upload(client, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}).json()
    with time_machine.travel(T0 + timedelta(seconds=3600), tick=False):
        assert prune_files() == [created["id"]]


@pytest.mark.django_db
def test_the_sweep_removes_bytes_no_record_owns_once_they_are_old(client, tmp_path):
    with time_machine.travel(T0, tick=False):
        kept = upload(client).json()["id"]
        orphan = file_storage().save("files/file-orphan.jsonl", SimpleUploadedFile("x", b"1\n"))
    # The file system stamps real time; stamp the frozen one.
    os.utime(file_storage().path(orphan), (T0.timestamp(), T0.timestamp()))
    with time_machine.travel(T0 + timedelta(minutes=5), tick=False):
        assert sweep_orphans() == []  # young bytes may be an upload being recorded now
    with time_machine.travel(T0 + timedelta(hours=2), tick=False):
        assert sweep_orphans() == [orphan]
    assert file_storage().exists(File.objects.get(pk=kept).storage_name)


@pytest.mark.django_db
def test_a_deleted_file_loses_its_bytes_and_is_gone_from_the_api(client):
    created = upload(client).json()
    storage_name = File.objects.get(pk=created["id"]).storage_name
    assert client.delete(f"/v1/files/{created['id']}").json() == {"id": created["id"], "object": "file", "deleted": True}
    assert not file_storage().exists(storage_name)
    assert client.get(f"/v1/files/{created['id']}").status_code == 404
    assert created["id"] not in [item["id"] for item in client.get("/v1/files").json()["data"]]
