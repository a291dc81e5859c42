"""/v1/webhook_endpoints in-process: OpenAI's shapes, the secret shown once, every refusal a 400
naming its field with nothing stored, and MILLM_WEBHOOK_ALLOWED_HOSTS."""

import json

import pytest

from webhooks_app.models import EVENT_TYPES, WebhookEndpoint

pytestmark = pytest.mark.django_db

ENDPOINTS = "/v1/webhook_endpoints"
GOOD = {"name": "pipeline", "url": "https://hooks.example.com/millm", "event_types": ["batch.completed"]}


def post(client, path, body):
    return client.post(path, json.dumps(body), content_type="application/json")


def test_create_answers_the_secret_once_and_then_only_its_hint(client):
    created = post(client, ENDPOINTS, GOOD)
    assert created.status_code == 200, created.content
    body = created.json()
    assert body["object"] == "webhook_endpoint" and body["id"].startswith("whep_")
    assert body["signing_secret"].startswith("whsec_") and body["event_types"] == ["batch.completed"]
    assert body["signing_secret_hint"].endswith(body["signing_secret"][-4:])
    assert body["created_at"] == body["updated_at"]

    shown = client.get(f"{ENDPOINTS}/{body['id']}").json()
    assert "signing_secret" not in shown and shown["signing_secret_hint"] == body["signing_secret_hint"]
    listed = client.get(ENDPOINTS).json()
    assert listed["object"] == "list" and [item["id"] for item in listed["data"]] == [body["id"]]
    assert body["signing_secret"] not in json.dumps(listed)


def test_update_changes_only_what_is_sent_and_moves_updated_at_only_on_a_change(client):
    endpoint = WebhookEndpoint.register(**GOOD)
    unchanged = post(client, f"{ENDPOINTS}/{endpoint.id}", {"name": "pipeline"}).json()
    assert unchanged["updated_at"] == int(endpoint.updated_at.timestamp())
    changed = post(client, f"{ENDPOINTS}/{endpoint.id}",
                   {"url": "http://127.0.0.1:9/hook", "event_types": ["batch.failed", "batch.failed", "batch.expired"]})
    assert changed.status_code == 200
    body = changed.json()
    assert body["url"] == "http://127.0.0.1:9/hook" and body["name"] == "pipeline"
    assert body["event_types"] == ["batch.failed", "batch.expired"]  # duplicates dropped, order kept
    endpoint.refresh_from_db()
    assert endpoint.updated_at.timestamp() >= endpoint.created_at.timestamp()


def test_delete_and_a_missing_id(client):
    endpoint = WebhookEndpoint.register(**GOOD)
    deleted = client.delete(f"{ENDPOINTS}/{endpoint.id}")
    assert deleted.json() == {"id": endpoint.id, "object": "webhook_endpoint.deleted", "deleted": True}
    missing = client.get(f"{ENDPOINTS}/{endpoint.id}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "webhook_endpoint_not_found"
    assert client.delete(f"{ENDPOINTS}/{endpoint.id}").status_code == 404


def test_the_event_types_listed_are_the_four_batch_ends(client):
    assert client.get("/v1/webhook_event_types").json() == {"object": "list", "data": list(EVENT_TYPES)}


@pytest.mark.parametrize("change, param, says", [
    ({"url": "ftp://hooks.example.com/x"}, "url", "http or https, got 'ftp'"),
    ({"url": "https://user:secret@hooks.example.com/x"}, "url", "credentials"),
    ({"url": "https:///path-only"}, "url", "no host"),
    ({"url": "https://hooks.example.com/" + "a" * 3000}, "url", "3026 characters; the limit is 2048"),
    ({"url": "https://hooks.example.com/a b"}, "url", "spaces"),
    ({"url": "https://hooks.example.com:99999/"}, "url", "not a valid URL"),
    ({"url": 12}, "url", "got 12"),
    ({"event_types": ["batch.completed", "response.completed"]}, "event_types.1", "'response.completed'"),
    ({"event_types": []}, "event_types", "non-empty list"),
    ({"event_types": "batch.completed"}, "event_types", "non-empty list"),
    ({"name": "n" * 300}, "name", "300 characters; the limit is 256"),
    ({"name": "  "}, "name", "non-empty string"),
    ({"secret": "mine"}, "secret", "Unknown field 'secret'"),
])
def test_bad_input_is_a_400_naming_the_field_and_stores_nothing(client, change, param, says):
    refused = post(client, ENDPOINTS, {**GOOD, **change})
    assert refused.status_code == 400, refused.content
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_webhook_request", param)
    assert says in error["message"]
    assert not WebhookEndpoint.objects.exists()


def test_a_missing_field_and_a_body_that_is_not_an_object(client):
    missing = post(client, ENDPOINTS, {"name": "x", "url": GOOD["url"]}).json()["error"]
    assert missing["param"] == "event_types" and "required" in missing["message"]
    assert post(client, ENDPOINTS, ["not", "an", "object"]).status_code == 400


def test_allowed_hosts_restrict_where_endpoints_may_point(client, settings):
    settings.MILLM_WEBHOOK_ALLOWED_HOSTS = ["hooks.example.com", "*.internal.example"]
    assert post(client, ENDPOINTS, GOOD).status_code == 200
    assert post(client, ENDPOINTS, {**GOOD, "url": "http://ci.internal.example/hook"}).status_code == 200
    refused = post(client, ENDPOINTS, {**GOOD, "url": "http://169.254.169.254/latest/meta-data"})
    assert refused.status_code == 400 and "'169.254.169.254' is not in MILLM_WEBHOOK_ALLOWED_HOSTS" in refused.json()["error"]["message"]


def test_rotation_answers_a_new_secret_and_keeps_the_old_one_signing_when_asked(client):
    endpoint = WebhookEndpoint.register(**GOOD)
    first = endpoint.secret
    rotated = post(client, f"{ENDPOINTS}/{endpoint.id}/rotate_secret", {"keep_old_secret_active_for_24_hours": True}).json()
    assert rotated["signing_secret"] != first
    endpoint.refresh_from_db()
    assert endpoint.signing_secrets() == [rotated["signing_secret"], first]
    again = post(client, f"{ENDPOINTS}/{endpoint.id}/rotate_secret", {}).json()
    endpoint.refresh_from_db()
    assert endpoint.signing_secrets() == [again["signing_secret"]]  # the default ends the old one at once
    bad = post(client, f"{ENDPOINTS}/{endpoint.id}/rotate_secret", {"keep_old_secret_active_for_24_hours": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_old_secret_active_for_24_hours"


def test_the_test_route_reports_the_receivers_answer_or_says_none_came(client, receiver):
    from tests.webhooks.receiver import Answer

    receiver.script("/hook", Answer(status=204, body=b""))
    endpoint = WebhookEndpoint.register(name="t", url=receiver.url + "/hook", event_types=["batch.completed"])
    tested = post(client, f"{ENDPOINTS}/{endpoint.id}/test", {"event_type": "batch.expired"})
    assert tested.json() == {"object": "webhook_endpoint.test", "webhook_endpoint_id": endpoint.id,
                             "event_type": "batch.expired", "status_code": 204, "success": True}
    (sent,) = receiver.at("/hook")
    assert json.loads(sent.body)["type"] == "batch.expired" and sent.headers["webhook-signature"].startswith("v1,")

    endpoint.change(url="http://127.0.0.1:9/nobody-listens")
    refused = post(client, f"{ENDPOINTS}/{endpoint.id}/test", {"event_type": "batch.expired"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "webhook_test_failed"
    unknown = post(client, f"{ENDPOINTS}/{endpoint.id}/test", {"event_type": "video.completed"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "event_type"
