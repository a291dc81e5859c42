"""What the ownership and quota tests share: the API as one key calls it (the Django test client,
through every middleware) and a batch ended as an engine ends it. The tests use
`inprocess_settings` (files in a folder of the test's own, events on a channel prefix of its own)."""

import json

from django.core.files.uploadedfile import SimpleUploadedFile

from batches_app import assembly
from batches_app.models import Batch
from files_app.models import file_storage
from millm_lib.ids import new_id
from millm_lib.limits import COMPLETIONS
from projects_app.models import ApiKey, Project
from tests.factories import jsonl, requests_of


def lines(count):
    return requests_of([{"model": "tiny-llama", "prompt": f"line {number}", "max_tokens": 1} for number in range(count)])


def stored_names():
    """The storage names of every file's bytes there are."""
    try:
        return sorted(f"files/{name}" for name in file_storage().listdir("files")[1])
    except FileNotFoundError:
        return []


class Caller:
    """One key's calls."""

    def __init__(self, client, key):
        self.client, self.key = client, key
        self.headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"}

    @classmethod
    def of_project(cls, client, name, admin=False):
        project = Project.objects.named(name, admin)
        caller = cls(client, ApiKey.objects.issue(project)[1])
        caller.project = project
        return caller

    def get(self, path):
        return self.client.get(path, **self.headers)

    def delete(self, path):
        return self.client.delete(path, **self.headers)

    def post(self, path, body=None, **headers):
        return self.client.post(path, json.dumps(body or {}), content_type="application/json", **self.headers, **headers)

    def upload(self, rows=1, body=None, **headers):
        content = body if body is not None else jsonl(lines(rows))
        return self.client.post("/v1/files", {"purpose": "batch", "file": SimpleUploadedFile("rows.jsonl", content)},
                                **self.headers, **headers)

    def file(self, rows=1):
        uploaded = self.upload(rows)
        assert uploaded.status_code == 200, uploaded.content
        return uploaded.json()["id"]

    def create_batch(self, file_id, **headers):
        return self.post("/v1/batches", {"input_file_id": file_id, "endpoint": COMPLETIONS, "completion_window": "24h"},
                         **headers)

    def batch(self, rows=1):
        created = self.create_batch(self.file(rows))
        assert created.status_code == 200, created.content
        return created.json()["id"]

    def ids(self, path):
        listed = self.get(path)
        assert listed.status_code == 200, listed.content
        return sorted(item["id"] for item in listed.json()["data"])


def end_batch(batch_id):
    """A cancelled batch's end, as an engine writes it: claimed, then assembled (its files
    recorded, its status ended)."""
    batch = Batch.objects.get(pk=batch_id)
    if batch.status in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS):
        batch.request_cancel()
    batch.claim(new_id("eng_"))
    return assembly.assemble(batch)
