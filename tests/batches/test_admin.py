"""The admin console: batches listed with progress, and cancel calling the model's method."""

from datetime import timedelta

import re

import pytest
from django.contrib.admin.utils import quote
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches_app.models import Batch
from files_app.models import File
from millm_lib.ids import new_id


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
    detail = admin_client.get(f"/admin/batches_app/batch/{quote(running.pk)}/change/")
    assert detail.status_code == 200


def in_progress(batch_id):
    upload = SimpleUploadedFile("in.jsonl", b"{}\n")
    upload.line_count = 1
    file, _ = File.record(upload, File.Purpose.BATCH, 3600)
    return Batch.objects.create(id=batch_id, endpoint="/v1/completions", input_file=file, completion_window="24h",
                                status=Batch.Status.IN_PROGRESS, expires_at=timezone.now() + timedelta(hours=1), total=10)


@pytest.mark.django_db
@pytest.mark.parametrize("batch_id", ["batch_409b2daca240391e0c5c3379", "batch_5f22aa2624253a3b3c3d3e3f"])
def test_the_cancel_button_works_for_ids_the_admin_quotes(admin_client, batch_id):
    """The admin reads "_40" in a URL as "@": an id holding one must be quoted in every link we build,
    or its page says the batch does not exist (1 id in 40 holds one of _22 _23 _24 _25 _26 _40)."""
    batch = in_progress(batch_id)
    page = admin_client.get(f"/admin/batches_app/batch/{quote(batch.pk)}/change/")
    assert page.status_code == 200 and 'id="progress-bar"' in page.content.decode()
    (action,) = re.findall(r'formaction="([^"]+)"', page.content.decode())
    answer = admin_client.post(action, follow=True)
    assert Batch.objects.get(pk=batch.pk).status == "cancelling"
    assert answer.redirect_chain[-1][0] == f"/admin/batches_app/batch/{quote(batch.pk)}/change/"
    assert 'id="progress-bar"' in answer.content.decode() and f"Cancelling {batch.id}." in answer.content.decode()
