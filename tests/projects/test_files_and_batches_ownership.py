"""Files and batches belong to the project that made them (issue 18, point 2): each project lists
only its own, another project's id answers exactly as an unknown one on every route that takes
it, a batch uses only its own project's files, an admin project sees everything, and the keys of
MILLM_API_KEYS are one project as before."""

import pytest
from django.utils import timezone

from batches_app import assembly
from batches_app.models import Batch
from files_app.models import File
from millm_lib.ids import new_id
from projects_app.models import Project
from tests.factories import BatchFactory, BatchRowFactory, FileFactory
from tests.projects.calls import Caller, lines

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("inprocess_settings")]


@pytest.fixture
def team_a(client):
    return Caller.of_project(client, "team-a")


@pytest.fixture
def team_b(client):
    return Caller.of_project(client, "team-b")


def test_each_project_lists_only_its_own_files_and_batches(team_a, team_b):
    a_batch, b_batch = team_a.batch(), team_b.batch()
    a_file, b_file = (Batch.objects.get(pk=pk).input_file_id for pk in (a_batch, b_batch))

    assert team_a.ids("/v1/files") == [a_file] and team_b.ids("/v1/files") == [b_file]
    assert team_a.ids("/v1/batches") == [a_batch] and team_b.ids("/v1/batches") == [b_batch]
    assert team_a.ids("/v1/files?purpose=batch") == [a_file]
    assert File.objects.get(pk=a_file).project == team_a.project
    assert Batch.objects.get(pk=b_batch).project == team_b.project


ROUTES = [
    ("get", "/v1/files/{file}"),
    ("get", "/v1/files/{file}/content"),
    ("delete", "/v1/files/{file}"),
    ("get", "/v1/batches/{batch}"),
    ("post", "/v1/batches/{batch}/cancel"),
    ("post", "/v1/batches/{batch}/lease"),
]


def answer(caller, method, route, file_id, batch_id):
    """The status and body of a call, with the id it named written as <id>: what tells one
    refusal from another."""
    response = getattr(caller, method)(route.format(file=file_id, batch=batch_id))
    named = file_id if "{file}" in route else batch_id
    return response.status_code, response.content.decode().replace(named, "<id>")


@pytest.mark.parametrize("method, route", ROUTES)
def test_another_projects_id_answers_exactly_as_an_unknown_id(team_a, team_b, method, route):
    a_batch = team_a.batch()
    a_file = Batch.objects.get(pk=a_batch).input_file_id

    theirs = answer(team_b, method, route, a_file, a_batch)
    unknown = answer(team_b, method, route, new_id("file-"), new_id("batch_"))

    assert theirs == unknown
    assert theirs[0] == 404
    # Nothing of team A's changed: its file is there, its batch not cancelled.
    assert team_a.get(f"/v1/files/{a_file}/content").status_code == 200
    assert team_a.get(f"/v1/batches/{a_batch}").json()["status"] == "validating"


def test_a_batch_naming_another_projects_file_is_404_as_an_unknown_file(team_a, team_b):
    a_file = team_a.file()

    theirs = team_b.create_batch(a_file)
    unknown_id = new_id("file-")
    unknown = team_b.create_batch(unknown_id)

    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["error"]["code"] == "file_not_found"
    assert theirs.content.decode().replace(a_file, "<id>") == unknown.content.decode().replace(unknown_id, "<id>")
    assert Batch.objects.count() == 0


def test_another_projects_deleted_file_is_unknown_not_deleted(team_a, team_b):
    a_file = team_a.file()
    assert team_a.delete(f"/v1/files/{a_file}").status_code == 200

    assert team_a.create_batch(a_file).json()["error"]["code"] == "file_deleted"  # the owner is told
    assert team_b.create_batch(a_file).json()["error"]["code"] == "file_not_found"


def test_an_idempotency_key_is_per_project(team_a, team_b):
    first = team_a.upload(**{"HTTP_IDEMPOTENCY_KEY": "same-key"}).json()["id"]
    again = team_a.upload(**{"HTTP_IDEMPOTENCY_KEY": "same-key"}).json()["id"]
    theirs = team_b.upload(**{"HTTP_IDEMPOTENCY_KEY": "same-key"})

    assert again == first
    assert theirs.status_code == 200 and theirs.json()["id"] != first  # not team A's file
    assert team_b.ids("/v1/files") == [theirs.json()["id"]]

    a_batch = team_a.create_batch(first, HTTP_IDEMPOTENCY_KEY="batch-key").json()["id"]
    b_batch = team_b.create_batch(theirs.json()["id"], HTTP_IDEMPOTENCY_KEY="batch-key").json()["id"]
    assert a_batch != b_batch and Batch.objects.get(pk=b_batch).project == team_b.project


def test_an_admin_project_sees_and_acts_on_every_projects_objects(client, team_a, team_b):
    admin = Caller.of_project(client, "operators", admin=True)
    a_batch, b_batch = team_a.batch(), team_b.batch()
    a_file, b_file = (Batch.objects.get(pk=pk).input_file_id for pk in (a_batch, b_batch))

    assert admin.ids("/v1/files") == sorted([a_file, b_file])
    assert admin.ids("/v1/batches") == sorted([a_batch, b_batch])
    assert admin.get(f"/v1/files/{a_file}/content").status_code == 200
    assert admin.post(f"/v1/batches/{b_batch}/cancel").json()["status"] == "cancelling"
    assert team_b.get(f"/v1/batches/{b_batch}").json()["status"] == "cancelling"
    assert team_a.ids("/v1/files") == [a_file]  # the admin's reading made nothing the others'


def test_the_keys_of_millm_api_keys_are_one_project_and_see_the_same_objects(client, settings):
    settings.MILLM_API_KEYS = ["k1", "k2"]
    first, second = Caller(client, "k1"), Caller(client, "k2")
    batch = first.batch()
    file_id = Batch.objects.get(pk=batch).input_file_id

    assert second.ids("/v1/files") == [file_id] and second.ids("/v1/batches") == [batch]
    assert second.get(f"/v1/files/{file_id}/content").status_code == 200
    assert second.post(f"/v1/batches/{batch}/cancel").json()["status"] == "cancelling"
    assert Batch.objects.get(pk=batch).project == Project.objects.default()
    assert client.get("/v1/files").status_code == 401


def test_a_batchs_output_and_error_files_are_its_projects(team_a, team_b):
    batch = BatchFactory(input_file=FileFactory(lines=lines(2)), project=team_a.project, status=Batch.Status.CANCELLING,
                         model="tiny-llama", total=2, in_progress_at=timezone.now())
    for line in (1, 2):
        BatchRowFactory(batch=batch, line=line)
    batch.claim(new_id("eng_"))

    ended = assembly.assemble(batch)

    assert ended.status == Batch.Status.CANCELLED
    for file in (ended.output_file, ended.error_file):
        assert file.project == team_a.project
        assert team_a.get(f"/v1/files/{file.pk}/content").status_code == 200
        assert team_b.get(f"/v1/files/{file.pk}/content").status_code == 404
    assert team_a.ids("/v1/files") == sorted([ended.output_file_id, ended.error_file_id])
