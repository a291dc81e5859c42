"""The admin console: batches listed with progress, and cancel calling the model's method."""

from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches_app.models import Batch
from files_app.models import File
from inference_app.models import new_id


@pytest.fixture(autouse=True)
def storage_in_tmp(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}


@pytest.mark.django_db
def test_the_admin_lists_batches_with_progress_and_cancels_them(admin_client):
    upload = SimpleUploadedFile("in.jsonl", b"{}\n")
    upload.line_count = 1
    file, _ = File.record(upload, File.Purpose.BATCH, 3600)
    running = Batch.objects.create(id=new_id("batch_"), endpoint="/v1/completions", input_file=file, completion_window="24h",
                                   status=Batch.Status.IN_PROGRESS, expires_at=timezone.now() + timedelta(hours=1),
                                   total=10, completed=4, failed=1, metadata={"team": "labels"})
    listing = admin_client.get("/admin/batches_app/batch/", {"q": "labels"})
    assert listing.status_code == 200
    assert running.id in listing.content.decode() and 'value="50"' in listing.content.decode()
    admin_client.post("/admin/batches_app/batch/", {"action": "cancel", "_selected_action": [running.pk]})
    assert Batch.objects.get(pk=running.pk).status == "cancelling"
    detail = admin_client.get(f"/admin/batches_app/batch/{running.pk}/change/")
    assert detail.status_code == 200
