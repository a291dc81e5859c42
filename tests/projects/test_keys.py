"""Keys in the database (issue 18, point 1): made by `createapikey` and the admin, shown once,
stored hashed, refused at once when revoked on HTTP routes and sockets; MILLM_API_KEYS and the
open server as before."""

import asyncio
import hashlib
import io
import logging

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.core.management import call_command
from django.db import connection, connections

from millm_site.asgi import application
from tests.e2e.test_security import keyed_routes
from projects_app.access import project_for_key
from projects_app.models import ApiKey, Project

pytestmark = pytest.mark.django_db(transaction=True)


def every_text_in_the_database():
    """Every text and JSON column of every table, as one string: what a leak would show in."""
    texts = []
    with connection.cursor() as cursor:
        cursor.execute("SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public' "
                       "AND data_type IN ('text', 'character varying', 'jsonb', 'json')")
        for table, column in cursor.fetchall():
            cursor.execute(f'SELECT "{column}"::text FROM "{table}"')
            texts.extend(value for (value,) in cursor.fetchall() if value)
    return "\n".join(texts)


def create_key(project, *flags):
    out, err = io.StringIO(), io.StringIO()
    call_command("createapikey", project, *flags, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


def test_the_command_prints_a_key_once_stores_only_its_hash_and_logs_nothing_of_it(client, caplog):
    caplog.set_level(logging.DEBUG)
    key, said = create_key("team-a", "--name", "labelling")
    assert key.startswith("mk_") and len(key) > 40
    stored = ApiKey.objects.get()
    assert stored.project.name == "team-a" and stored.name == "labelling" and not stored.project.is_admin
    assert stored.key_hash == hashlib.sha256(key.encode()).hexdigest() and key[-4:] in stored.hint
    assert stored.hint in said and key not in said

    assert client.get("/v1/files", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200
    assert client.get("/v1/files", HTTP_AUTHORIZATION="Bearer mk_wrong").status_code == 401
    assert key not in every_text_in_the_database()
    assert key not in caplog.text


def test_a_second_key_for_the_same_project_and_an_admin_project(client):
    first, _ = create_key("team-a")
    second, _ = create_key("team-a")
    boss, _ = create_key("operators", "--admin")
    assert first != second and Project.objects.get(name="team-a").keys.count() == 2
    assert Project.objects.get(name="operators").is_admin
    assert project_for_key(first) == project_for_key(second) != project_for_key(boss)


def test_once_a_key_exists_the_server_needs_one_and_revoking_refuses_it_at_once(client):
    assert client.get("/v1/files").status_code == 200  # no key anywhere: the open server
    key, _ = create_key("team-a")
    missing = client.get("/v1/files")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/api/health").status_code == 200  # health never needs one
    assert client.get("/v1/files", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200

    ApiKey.objects.get().revoke()
    revoked = client.get("/v1/files", HTTP_AUTHORIZATION=f"Bearer {key}")
    assert revoked.status_code == 401 and "revoked" in revoked.json()["error"]["message"]
    # Every keyed route, as the URL resolver lists them (tests/e2e/test_security.py's walk).
    for route, path in keyed_routes():
        for method in ("GET", "POST", "DELETE"):
            answer = client.generic(method, path, HTTP_AUTHORIZATION=f"Bearer {key}")
            assert answer.status_code == 401, (method, route, answer.status_code)
    assert client.get("/v1/files").status_code == 401  # revoking the last key never opens the server


def test_a_revoked_key_is_refused_by_the_websocket_and_socket_io(client):
    key, _ = create_key("team-a")

    async def websocket(token):
        communicator = WebsocketCommunicator(application, "/ws/batches/", headers=[
            (b"host", b"testserver"), (b"authorization", f"Bearer {token}".encode())])
        connected, _ = await communicator.connect()
        await communicator.disconnect()
        await database_sync_to_async(connections.close_all)()
        return connected

    assert asyncio.run(websocket(key))
    ApiKey.objects.get().revoke()
    assert not asyncio.run(websocket(key))
    assert project_for_key(key) is None  # what Socket.IO's connect asks, too


def test_millm_api_keys_are_the_default_project_and_work_beside_database_keys(client, settings):
    settings.MILLM_API_KEYS = ["sk-one", "sk-two"]
    assert project_for_key("sk-one") == project_for_key("sk-two") == Project.objects.default()
    assert client.get("/v1/files", HTTP_AUTHORIZATION="Bearer sk-two").status_code == 200
    assert client.get("/v1/files").status_code == 401
    key, _ = create_key("team-a")
    assert project_for_key(key).name == "team-a"
    assert client.get("/v1/files", HTTP_AUTHORIZATION="Bearer sk-one").status_code == 200


def test_the_admin_makes_a_key_shows_it_once_and_revokes_it(admin_client, client):
    project = Project.objects.named("team-b")
    made = admin_client.post("/admin/projects_app/apikey/add/", {"project": project.pk, "name": "ci"})
    assert made.status_code == 200
    page = made.content.decode()
    stored = ApiKey.objects.get()
    key = page.split('id="new-api-key">', 1)[1].split("<", 1)[0]
    assert key.startswith("mk_") and stored.key_hash == hashlib.sha256(key.encode()).hexdigest()
    listed = admin_client.get("/admin/projects_app/apikey/").content.decode()
    assert stored.hint in listed and key not in listed
    assert key not in admin_client.get(f"/admin/projects_app/apikey/{stored.pk}/change/").content.decode()
    assert key not in every_text_in_the_database()  # nor in the session the admin wrote
    assert client.get("/v1/files", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 200

    admin_client.post("/admin/projects_app/apikey/", {"action": "revoke", "_selected_action": [stored.pk]})
    assert client.get("/v1/files", HTTP_AUTHORIZATION=f"Bearer {key}").status_code == 401
    assert admin_client.get(f"/admin/projects_app/apikey/{stored.pk}/delete/").status_code == 403
