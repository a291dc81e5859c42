"""The operator's console (issue 16, point 3, begun): nothing added by hand that only the API or
the engine creates, no Save or Delete under a running batch, deletes through the models' own
methods, leases ended by their own release, the catalogue's state read-only."""

import re
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.contrib.admin.utils import quote
from django.utils import timezone

from batches_app.models import Batch, BatchRow
from files_app.models import File
from inference_app.models import Lease, ModelEntry
from tests.factories import BatchFactory, BatchRowFactory, FileFactory, LeaseFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def storage_in_tmp(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}


@pytest.mark.parametrize("page", ["batches_app/batch", "inference_app/engine", "inference_app/lease", "files_app/file"])
def test_no_add_for_what_only_the_api_or_the_engine_creates(admin_client, page):
    assert admin_client.get(f"/admin/{page}/add/").status_code == 403


def test_a_running_batch_page_has_no_save_and_cannot_be_deleted(admin_client):
    running = BatchFactory(input_file=FileFactory(lines=[{}]), status=Batch.Status.IN_PROGRESS)
    BatchRowFactory(batch=running, line=1)
    page = admin_client.get(f"/admin/batches_app/batch/{quote(running.pk)}/change/").content.decode()
    assert 'name="_save"' not in page and "/delete/" not in page
    # The cancel button still posts: it sits inside the page's form (a view-only page keeps it).
    button = page.index('id="cancel-batch"')
    assert page.index('id="batch_form"') < button < page.index("</form>", button)
    assert admin_client.post(f"/admin/batches_app/batch/{quote(running.pk)}/delete/", {"post": "yes"}).status_code == 403
    admin_client.post("/admin/batches_app/batch/", {"action": "delete_selected", "_selected_action": [running.pk], "post": "yes"})
    assert Batch.objects.filter(pk=running.pk).exists() and BatchRow.objects.filter(batch=running).count() == 1


def test_a_finished_batch_is_deleted_with_its_rows(admin_client):
    done = BatchFactory(input_file=FileFactory(lines=[{}]), status=Batch.Status.COMPLETED)
    BatchRowFactory(batch=done, line=1, outcome=BatchRow.Outcome.SUCCEEDED)
    admin_client.post(f"/admin/batches_app/batch/{quote(done.pk)}/delete/", {"post": "yes"})
    assert not Batch.objects.filter(pk=done.pk).exists() and not BatchRow.objects.filter(batch_id=done.pk).exists()


def test_a_file_a_running_batch_needs_is_refused_with_the_reason_and_another_is_removed(admin_client):
    needed = FileFactory(lines=[{}])
    running = BatchFactory(input_file=needed, status=Batch.Status.IN_PROGRESS)
    refused = admin_client.post(f"/admin/files_app/file/{needed.pk}/delete/", {"post": "yes"}, follow=True)
    assert running.pk in refused.content.decode()
    assert File.objects.get(pk=needed.pk).status != File.Status.DELETED

    spare = FileFactory(lines=[{}])
    admin_client.post(f"/admin/files_app/file/{spare.pk}/delete/", {"post": "yes"})
    assert File.objects.get(pk=spare.pk).status == File.Status.DELETED  # File.remove: the record stays


def test_a_lease_is_ended_by_its_own_release(admin_client):
    lease = LeaseFactory()
    admin_client.post("/admin/inference_app/lease/", {"action": "end", "_selected_action": [lease.pk]})
    lease.refresh_from_db()
    assert lease.ended_at is not None and lease.end_reason == "released"
    assert not Lease.objects.get(pk=lease.pk).live


def test_the_catalogues_state_is_read_only(admin_client):
    entry = ModelEntry.objects.create(id="org/model", source="/models/org/model", source_format="folder")
    page = admin_client.get(f"/admin/inference_app/modelentry/{quote(entry.pk)}/change/").content.decode()
    assert 'name="state"' not in page and 'name="weights_state"' not in page


def body_of(response):
    """A streamed answer's bytes: the downloads stream as an asynchronous iterator (under ASGI a
    synchronous one would be read whole into memory first)."""
    async def collect():
        return b"".join([chunk async for chunk in response.streaming_content])

    return async_to_sync(collect)()


def test_a_batchs_files_download_for_staff_only_and_rows_filter_by_outcome(admin_client, client):
    batch = BatchFactory(input_file=FileFactory(lines=[{"custom_id": "a"}]), status=Batch.Status.IN_PROGRESS)
    BatchRowFactory(batch=batch, line=1, outcome=BatchRow.Outcome.SUCCEEDED, response={"object": "text_completion"})
    BatchRowFactory(batch=batch, line=2, outcome=BatchRow.Outcome.FAILED,
                    error={"status": 400, "code": "context_length_exceeded", "message": "Line 2: too long"})
    download = f"/admin/batches_app/batch/{quote(batch.pk)}/download/input/"

    answer = admin_client.get(download)
    assert answer.status_code == 200 and body_of(answer) == b'{"custom_id": "a"}\n'
    assert "attachment" in answer["Content-Disposition"]
    assert client.get(download).status_code == 302  # no staff session: to the login page
    assert admin_client.get(f"/admin/batches_app/batch/{quote(batch.pk)}/download/output/").status_code == 404

    page = admin_client.get(f"/admin/batches_app/batch/{quote(batch.pk)}/change/", {"outcome": "failed"}).content.decode()
    assert "context_length_exceeded: Line 2: too long" in page and "text_completion" not in page
    assert 'id="download-input"' in page and 'id="download-output"' not in page
    page = admin_client.get(f"/admin/batches_app/batch/{quote(batch.pk)}/change/").content.decode()
    assert "text_completion" in page  # a response preview


def test_a_running_batch_page_leads_with_its_pace_and_groups_the_rest(admin_client):
    batch = BatchFactory(input_file=FileFactory(lines=[{}]), status=Batch.Status.IN_PROGRESS, total=30, completed=10,
                         in_progress_at=timezone.now() - timedelta(seconds=10))
    page = admin_client.get(f"/admin/batches_app/batch/{quote(batch.pk)}/change/").content.decode()
    assert re.search(r'id="progress-pace">1\.0 rows/s, ETA 2\d s<', page)
    for group in ("Files", "Times", "Options", "Internals"):
        assert re.search(rf'class="fieldset-heading">{group}</h2>', page), group
    assert page.index("field-status") < page.index("field-claim_token")


def test_the_index_shows_the_engines_and_the_batch_backlog_by_model(admin_client):
    running = BatchFactory(status=Batch.Status.IN_PROGRESS, model="tiny-llama", total=3)
    for line, outcome in ((1, BatchRow.Outcome.SUCCEEDED), (2, BatchRow.Outcome.PENDING), (3, BatchRow.Outcome.PENDING)):
        BatchRowFactory(batch=running, line=line, outcome=outcome)
    BatchRowFactory(batch=BatchFactory(), line=1)  # a validating batch: its model is not known yet
    index = admin_client.get("/admin/").content.decode()
    assert 'id="engine-health"' in index
    (backlog,) = re.findall(r'<p id="batch-backlog">(.*?)</p>', index)
    assert backlog == "Batch rows not yet run: <strong>3</strong> ((validating): 1, tiny-llama: 2)"
