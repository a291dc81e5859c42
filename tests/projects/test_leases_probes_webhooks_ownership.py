"""Leases, probes and webhook endpoints belong to the project that made them (issue 18, point 2):
another project's id is answered exactly as an unknown one on every route that takes it, a live
lease still binds every project (its holder named), and an admin project acts on them all.
In-process: Django's test client on the real database, and for the routes the engine checks
itself (load, unload, weights, save, a request's load, probe scores) a real engine in a thread."""

import json
import secrets

import pytest
from django.utils import timezone

from batches_app import leasing
from batches_app.models import Batch
from inference_app.models import Lease, ModelEntry, Probe
from inference_app.schemas import parse_request
from millm_lib.errors import ApiError
from millm_lib.limits import COMPLETIONS, PROBE_SCORE
from projects_app.models import Project
from tests.batches.inprocess import MODEL, batch_is, run_engine_until, scoring
from tests.factories import BatchFactory, EngineFactory, FileFactory, requests_of
from webhooks_app.models import Delivery, WebhookEndpoint

LEASE = f"/api/models/{MODEL}/lease"
HOOKS = "/v1/webhook_endpoints"


def unknown_lease():
    return "lease_" + secrets.token_hex(20)


def send(client, method, path, team, body=None, lease=None):
    headers = team.headers(**({"HTTP_X_MILLM_LEASE": lease} if lease else {}))
    if body is None:
        return getattr(client, method)(path, **headers)
    return getattr(client, method)(path, json.dumps(body), content_type="application/json", **headers)


def assert_answered_as_unknown(theirs, unknown, their_id=None, unknown_id=None, status=404):
    """The same status and the same body, byte for byte but for the id itself: no oracle."""
    assert theirs.status_code == unknown.status_code == status, (theirs.content, unknown.content)
    expected = unknown.content.decode()
    if their_id is not None:
        expected = expected.replace(unknown_id, their_id)
    assert theirs.content.decode() == expected
    assert theirs.headers.get("x-should-retry") == unknown.headers.get("x-should-retry")


def refusal(call):
    with pytest.raises(ApiError) as refused:
        call()
    error = refused.value
    return error.status, error.code, error.message, error.param, error.details


# --- leases ---


@pytest.fixture
def leasable():
    """The test model resident on a live engine's row: enough to take, renew and release leases."""
    ModelEntry.objects.create(id=MODEL, source="/nowhere", source_format="folder", state="resident")
    EngineFactory(model_id=MODEL, resident_model_id=MODEL)


def acquire(client, team, holder="team-a-trainer"):
    answer = send(client, "post", LEASE, team, {"holder": holder, "reason": "fine-tuning"})
    assert answer.status_code == 201, answer.content
    return answer.json()["data"]["id"]


@pytest.mark.django_db
def test_another_projects_lease_is_unknown_to_renew_and_release_yet_binds_its_acquire(client, teams, leasable):
    lease_id = acquire(client, teams.a)
    assert Lease.objects.get().project == teams.a.project

    for method, path in (("post", f"{LEASE}/renew"), ("delete", LEASE)):
        theirs = send(client, method, path, teams.b, lease=lease_id)
        assert_answered_as_unknown(theirs, send(client, method, path, teams.b, lease=unknown_lease()))
        assert theirs.json()["error"]["code"] == "LEASE_NOT_FOUND"
    assert Lease.objects.get().live  # B's release did nothing

    blocked = send(client, "post", LEASE, teams.b, {"holder": "team-b", "reason": "mine now"})
    assert blocked.status_code == 409 and blocked.json()["error"]["code"] == "MODEL_LEASED"
    assert "team-a-trainer" in blocked.json()["error"]["message"]
    status = send(client, "get", LEASE, teams.b).json()["data"]  # who holds it is no secret; its id is
    assert status["holder"] == "team-a-trainer" and "id" not in status


@pytest.mark.django_db
def test_the_owner_and_an_admin_project_act_with_the_lease(client, teams, leasable):
    lease_id = acquire(client, teams.a)
    assert send(client, "post", f"{LEASE}/renew", teams.admin, lease=lease_id).status_code == 200
    assert send(client, "post", f"{LEASE}/renew", teams.a, lease=lease_id).status_code == 200
    released = send(client, "delete", LEASE, teams.admin, lease=lease_id)
    assert released.status_code == 200 and released.json()["data"]["released"] is True


@pytest.mark.django_db
def test_a_batch_is_neither_created_under_nor_handed_another_projects_lease(client, teams, leasable):
    lease_id = acquire(client, teams.a)
    file = FileFactory(lines=requests_of([{"model": MODEL, "prompt": "hi", "max_tokens": 1}]))

    def create(lease, project):
        return lambda: leasing.lease_for_new_batch(lease, file, COMPLETIONS, project=project)

    theirs = refusal(create(lease_id, teams.b.project))
    assert theirs == refusal(create(unknown_lease(), teams.b.project)) and theirs[:2] == (404, "lease_not_found")
    assert create(lease_id, teams.a.project)().pk == create(lease_id, teams.admin.project)().pk

    b_batch = BatchFactory(input_file=file, model=MODEL, project=teams.b.project)
    theirs = refusal(lambda: b_batch.hand_lease(lease_id, teams.b.project))
    assert theirs == refusal(lambda: b_batch.hand_lease(unknown_lease(), teams.b.project))
    assert theirs == refusal(lambda: b_batch.hand_lease(lease_id))  # by default: the batch's own project
    assert Batch.objects.get(pk=b_batch.pk).lease_id is None
    assert b_batch.hand_lease(lease_id, teams.admin.project).lease.project == teams.a.project

    a_batch = BatchFactory(input_file=file, model=MODEL, project=teams.a.project)
    assert a_batch.hand_lease(lease_id).lease_id == Lease.objects.get().pk


@pytest.mark.django_db(transaction=True)
def test_the_engine_answers_another_projects_lease_as_unknown_on_every_route_it_checks(client, teams, serving_engine):
    ModelEntry.objects.create(id="tiny-other", source="/nowhere", source_format="folder")
    lease_id = acquire(client, teams.a)
    model = f"/api/models/{MODEL}"
    routes = [
        ("post", "/api/models/tiny-other/load", {}),
        ("post", f"{model}/unload", None),
        ("post", f"{model}/weights/begin", None),
        ("put", f"{model}/weights", {}),
        ("post", f"{model}/weights/commit", None),
        ("post", f"{model}/save", None),
        ("post", "/v1/completions", {"model": "tiny-other", "prompt": "hi", "max_tokens": 1}),
    ]
    for method, path, body in routes:
        theirs = send(client, method, path, teams.b, body, lease=lease_id)
        assert_answered_as_unknown(theirs, send(client, method, path, teams.b, body, lease=unknown_lease()))
        assert "lease_not_found" in theirs.content.decode().lower(), path

    blocked = send(client, "post", "/api/models/tiny-other/load", teams.b, {})
    assert blocked.status_code == 409 and "team-a-trainer" in blocked.json()["error"]["message"]
    assert serving_engine.runtime.model_id == MODEL  # nothing was unloaded or swapped
    for team in (teams.a, teams.admin):
        assert send(client, "post", f"{model}/weights/begin", team, lease=lease_id).status_code == 200
        assert send(client, "post", f"{model}/weights/commit", team, lease=lease_id).status_code == 200


# --- probes ---


def probe_import(model="tiny-resident", width=64, **fields):
    return {"name": "sentiment", "model": model, "layer": 1, "weights": [0.5] * width, "aggregation": "mean", **fields}


@pytest.fixture
def resident_model():
    """A live active engine's row with a 2-layer, 64-wide model resident: enough to import probes."""
    entry = ModelEntry.objects.create(id="tiny-resident", source="/nowhere", source_format="folder",
                                      state="resident", hidden_size=64, num_layers=2)
    EngineFactory(model_id=entry.pk, resident_model_id=entry.pk)


def import_probe(client, team, **fields):
    answer = send(client, "post", "/api/probes", team, probe_import(**fields))
    assert answer.status_code == 201, answer.content
    return answer.json()["data"]["id"]


@pytest.mark.django_db
def test_probes_are_listed_read_deleted_and_scored_only_by_their_project(client, teams, resident_model):
    a_probe, b_probe = import_probe(client, teams.a), import_probe(client, teams.b)
    assert Probe.objects.get(pk=a_probe).project == teams.a.project

    def listed(team):
        return {probe["id"] for probe in send(client, "get", "/api/probes", team).json()["data"]}

    assert listed(teams.a) == {a_probe} and listed(teams.b) == {b_probe}
    assert listed(teams.admin) == {a_probe, b_probe}

    unknown = "probe_" + secrets.token_hex(12)
    for method in ("get", "delete"):
        theirs = send(client, method, f"/api/probes/{a_probe}", teams.b)
        assert_answered_as_unknown(theirs, send(client, method, f"/api/probes/{unknown}", teams.b), a_probe, unknown)
    score = {"inputs": [{"text": "hello"}]}
    theirs = send(client, "post", "/api/probes/score", teams.b, {**score, "probe_ids": [a_probe]})
    assert_answered_as_unknown(theirs, send(client, "post", "/api/probes/score", teams.b, {**score, "probe_ids": [unknown]}),
                               a_probe, unknown)
    assert theirs.json()["error"]["code"] == "PROBE_NOT_FOUND"

    assert send(client, "get", f"/api/probes/{a_probe}", teams.admin).status_code == 200
    assert send(client, "delete", f"/api/probes/{a_probe}", teams.a).status_code == 200
    assert Probe.objects.filter(pk=b_probe).exists()


@pytest.mark.django_db(transaction=True)
def test_the_engine_scores_only_the_callers_own_probes(client, teams, serving_engine):
    a_probe = import_probe(client, teams.a, model=MODEL)
    score = {"inputs": [{"text": "hello"}]}

    scored = send(client, "post", "/api/probes/score", teams.a, score)
    assert scored.status_code == 200, scored.content
    assert a_probe in scored.content.decode()
    # Team B has no probe of its own: the engine answers as if team A's did not exist.
    alone = send(client, "post", "/api/probes/score", teams.b, score)
    assert alone.status_code == 400 and "has no probes" in alone.json()["error"]["message"]
    assert send(client, "post", "/api/probes/score", teams.admin, score).status_code == 200

    # A batch row scores in the engine with its batch's project (the runner's call).
    unknown_id = "probe_" + secrets.token_hex(12)
    request = parse_request(PROBE_SCORE, {**score, "probe_ids": [a_probe]}, True).request
    unknown_request = parse_request(PROBE_SCORE, {**score, "probe_ids": [unknown_id]}, True).request
    theirs = refusal(lambda: serving_engine.probes_for(request, teams.b.project))
    status, code, message, param, details = refusal(lambda: serving_engine.probes_for(unknown_request, teams.b.project))
    assert theirs == (status, code, message.replace(unknown_id, a_probe), param, details)
    assert (status, code) == (404, "probe_not_found")
    assert [spec["id"] for spec in serving_engine.probes_for(request, teams.a.project)] == [a_probe]


# --- webhook endpoints ---

ENDPOINT = {"name": "pipeline", "url": "https://hooks.example.com/millm", "event_types": ["batch.completed"]}


def register(client, team):
    answer = send(client, "post", HOOKS, team, ENDPOINT)
    assert answer.status_code == 200, answer.content
    return answer.json()


@pytest.mark.django_db
def test_webhook_endpoints_answer_only_their_project_on_every_route(client, teams):
    a_hook, b_hook = register(client, teams.a), register(client, teams.b)
    assert WebhookEndpoint.objects.get(pk=a_hook["id"]).project == teams.a.project

    def listed(team):
        return {item["id"] for item in send(client, "get", HOOKS, team).json()["data"]}

    assert listed(teams.a) == {a_hook["id"]} and listed(teams.b) == {b_hook["id"]}
    assert listed(teams.admin) == {a_hook["id"], b_hook["id"]}

    unknown = "whep_" + secrets.token_hex(12)
    routes = [("get", "", None), ("post", "", {"name": "taken over"}), ("delete", "", None),
              ("post", "/test", {}), ("post", "/rotate_secret", {}), ("get", "/deliveries", None)]
    for method, suffix, body in routes:
        theirs = send(client, method, f"{HOOKS}/{a_hook['id']}{suffix}", teams.b, body)
        assert_answered_as_unknown(theirs, send(client, method, f"{HOOKS}/{unknown}{suffix}", teams.b, body),
                                   a_hook["id"], unknown)
        assert theirs.json()["error"]["code"] == "webhook_endpoint_not_found"
    kept = WebhookEndpoint.objects.get(pk=a_hook["id"])
    assert kept.name == "pipeline" and kept.secret == a_hook["signing_secret"]

    assert send(client, "get", f"{HOOKS}/{a_hook['id']}", teams.admin).status_code == 200
    assert send(client, "post", f"{HOOKS}/{a_hook['id']}", teams.a, {"name": "renamed"}).json()["name"] == "renamed"


def subscribe(project):
    return WebhookEndpoint.register(**ENDPOINT, project=project)


@pytest.mark.django_db
def test_a_batch_end_is_delivered_only_to_its_own_projects_endpoints(teams):
    default = Project.objects.default()
    to = {name: subscribe(project).pk for name, project in
          (("a", teams.a.project), ("b", teams.b.project), ("admin", teams.admin.project), ("default", default),
           ("none", None))}

    def told(project):
        deliveries = Delivery.objects.enqueue("batch.completed", {"id": "batch_x"}, timezone.now(), project=project)
        return {name for name, pk in to.items() if pk in {delivery.endpoint_id for delivery in deliveries}}

    assert told(teams.a.project) == {"a"}
    assert told(teams.admin.project) == {"admin"}  # an admin project sees all, but hears its own
    # A batch with no project is the default project's, and so is an endpoint with none.
    assert told(default) == told(None) == {"default", "none"}


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("inprocess_settings")
def test_a_batch_that_ends_in_the_engine_tells_only_its_projects_endpoints(teams, start_engine):
    mine, theirs = subscribe(teams.a.project), subscribe(teams.b.project)
    batch = BatchFactory(input_file=FileFactory(lines=requests_of([scoring("One")])), project=teams.a.project)
    run_engine_until(start_engine(), batch_is(batch.id, Batch.Status.COMPLETED))
    assert [delivery.endpoint_id for delivery in Delivery.objects.all()] == [mine.pk]
    assert not Delivery.objects.filter(endpoint=theirs).exists()
