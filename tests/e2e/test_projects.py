"""Keys as tenants end to end (issue 18), on real processes: two projects' keys (made by
`manage.py createapikey`) and an admin project's. Each project lists only its own files, batches,
probes and webhook endpoints; every route that takes a file, batch, probe or endpoint id in its
path (enumerated from the URL resolver, as tests/e2e/test_security.py does), and every id a
body or header carries (an input file, probe ids, a lease), answers another project's id exactly
as an unknown one; events reach only the owner and the admin; a quota's refusal is the SDK's
RateLimitError."""

import asyncio
import hashlib
import json
import re
import subprocess

import httpx
import openai
import pytest

from tests.e2e.batch_helpers import FINISHED, line, start_batch, to_jsonl, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.stack import PYTHON, ROOT, Stack, wait_until
from tests.e2e.test_security import http_routes

COMPLETIONS = "/v1/completions"
METHODS = ["GET", "POST", "DELETE"]
UNKNOWN = {"file": "file-" + "0" * 24, "batch": "batch_" + "0" * 24, "probe": "probe_" + "0" * 24,
           "endpoint": "whep_" + "0" * 24, "response": "resp_" + "0" * 24}
# Which kind of id each path parameter of an owned route takes, by the route's family.
FAMILIES = {"v1/files": "file", "v1/batches": "batch", "api/probes": "probe", "v1/webhook_endpoints": "endpoint",
            "v1/responses": "response"}


def create_key(stack, project, *flags):
    made = subprocess.run([PYTHON, "manage.py", "createapikey", project, *flags], cwd=ROOT, env=stack.env,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


class Tenant:
    def __init__(self, stack, key):
        self.key, self.url = key, stack.web.url
        self.client = make_client(stack.web.url, api_key=key)

    def call(self, method, path, **kwargs):
        headers = {"Authorization": f"Bearer {self.key}", **kwargs.pop("headers", {})}
        return httpx.request(method, self.url + path, headers=headers, timeout=60, **kwargs)


def scoring_lines(count, prefix):
    return [line(f"{prefix}-{i}", COMPLETIONS, {"model": MODEL_ID, "prompt": f"Item {i}:", "max_tokens": 1})
            for i in range(count)]


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, test_model_dir):
    """Projects alpha and beta and the operators' admin project, each with what it made: a file,
    a finished batch, a probe, a webhook endpoint."""
    with Stack.running(tmp_path_factory.mktemp("projects"), test_model_dir, BATCH_WAIT_POLL_S=0.2) as stack:
        stack.alpha = Tenant(stack, create_key(stack, "alpha"))
        stack.beta = Tenant(stack, create_key(stack, "beta"))
        stack.admin = Tenant(stack, create_key(stack, "operators", "--admin"))
        for tenant, name in ((stack.alpha, "alpha"), (stack.beta, "beta")):
            tenant.batch = wait_for(tenant.client, start_batch(tenant.client, scoring_lines(2, name), COMPLETIONS).id)
            tenant.file = tenant.batch.input_file_id
            probe = tenant.call("POST", "/api/probes", json={
                "name": f"{name}-probe", "model": MODEL_ID, "layer": 1, "weights": [0.1] * 64, "aggregation": "mean"})
            assert probe.status_code == 201, probe.text
            tenant.probe = probe.json()["data"]["id"]
            tenant.endpoint = tenant.client.webhooks.create(name=name, url="http://127.0.0.1:9/hook",
                                                             event_types=["batch.failed"]).id
            tenant.response = tenant.client.responses.create(model=MODEL_ID, input=name, max_output_tokens=2).id
        yield stack


def ids_of(tenant):
    return {"file": tenant.file, "batch": tenant.batch.id, "probe": tenant.probe, "endpoint": tenant.endpoint,
            "response": tenant.response}


def owned_routes():
    """(family, concrete path with {id}) of every route whose path carries an owned object's id."""
    routes = []
    for route, _ in http_routes():
        text = route.strip("^$")
        family = next((kind for prefix, kind in FAMILIES.items() if text.startswith(prefix + "/")), None)
        if family is None or not re.search(r"<|\(\?P", text):
            continue
        path = "/" + re.sub(r"\(\?P<\w+>[^)]*\)|<(?:\w+:)?\w+>", "{id}", text).replace("\\", "")
        routes.append((family, path))
    return routes


def same_answer(other, unknown, other_id, unknown_id, refused=True):
    """Another project's id and an unknown one answer alike: status and body (the id aside); a
    404 where `refused` (a lease the route need not use, as a load of the resident model, may
    answer alike without one)."""
    assert other.status_code == unknown.status_code, (other.status_code, other.text, unknown.text)
    if other.status_code == 405:
        return
    if refused:
        assert other.status_code == 404, other.text
    assert other.text.replace(other_id, "ID") == unknown.text.replace(unknown_id, "ID")


def test_each_project_lists_only_its_own_and_the_admin_sees_both(tenants):
    alpha, beta, admin = tenants.alpha, tenants.beta, tenants.admin
    for tenant, other in ((alpha, beta), (beta, alpha)):
        files = {item.id for item in tenant.client.files.list()}
        batches = {item.id for item in tenant.client.batches.list()}
        endpoints = {item.id for item in tenant.client.webhooks.list()}
        probes = {item["id"] for item in tenant.call("GET", "/api/probes").json()["data"]}
        assert tenant.file in files and other.file not in files
        assert tenant.batch.output_file_id in files and other.batch.output_file_id not in files
        assert batches == {tenant.batch.id}
        assert endpoints == {tenant.endpoint} and probes == {tenant.probe}
    assert {alpha.batch.id, beta.batch.id} <= {item.id for item in admin.client.batches.list()}
    assert {alpha.file, beta.file} <= {item.id for item in admin.client.files.list()}
    assert admin.client.batches.retrieve(beta.batch.id).id == beta.batch.id


def test_every_route_answers_another_projects_id_as_an_unknown_one(tenants):
    alpha, beta = tenants.alpha, tenants.beta
    routes = owned_routes()
    assert {family for family, _ in routes} == set(FAMILIES.values())  # the walk found every family
    assert len(routes) >= 10
    theirs = ids_of(beta)
    exercised = 0
    for family, path in routes:
        for method in METHODS:
            body = {"json": {}} if method == "POST" else {}
            other = alpha.call(method, path.format(id=theirs[family]), **body)
            unknown = alpha.call(method, path.format(id=UNKNOWN[family]), **body)
            same_answer(other, unknown, theirs[family], UNKNOWN[family])
            exercised += other.status_code == 404
    assert exercised >= 12
    # Nothing of beta's changed: its file, batch, probe and endpoint are all still there, as they were.
    assert beta.client.files.retrieve(beta.file).status == "processed"
    assert beta.client.batches.retrieve(beta.batch.id).status == "completed"
    assert beta.call("GET", f"/api/probes/{beta.probe}").status_code == 200
    assert beta.client.webhooks.retrieve(beta.endpoint).id == beta.endpoint
    assert beta.client.responses.retrieve(beta.response).id == beta.response


def test_ids_in_bodies_and_headers_answer_as_unknown_ones_too(tenants):
    alpha, beta = tenants.alpha, tenants.beta
    create = {"endpoint": COMPLETIONS, "completion_window": "24h"}
    other = alpha.call("POST", "/v1/batches", json={**create, "input_file_id": beta.file})
    unknown = alpha.call("POST", "/v1/batches", json={**create, "input_file_id": UNKNOWN["file"]})
    same_answer(other, unknown, beta.file, UNKNOWN["file"])

    chained = {"model": MODEL_ID, "input": "more", "max_output_tokens": 2}
    other = alpha.call("POST", "/v1/responses", json={**chained, "previous_response_id": beta.response})
    unknown = alpha.call("POST", "/v1/responses", json={**chained, "previous_response_id": UNKNOWN["response"]})
    same_answer(other, unknown, beta.response, UNKNOWN["response"])

    score = {"inputs": [{"text": "hello"}]}
    other = alpha.call("POST", "/api/probes/score", json={**score, "probe_ids": [beta.probe]})
    unknown = alpha.call("POST", "/api/probes/score", json={**score, "probe_ids": [UNKNOWN["probe"]]})
    same_answer(other, unknown, beta.probe, UNKNOWN["probe"])

    taken = beta.call("POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "beta", "reason": "sweep", "ttl_seconds": 120})
    assert taken.status_code == 201, taken.text
    lease = taken.json()["data"]["id"]
    try:
        unknown_lease = "lease_" + "0" * 40
        # Every route that takes a lease: the model routes (as the resolver lists them) and a batch's.
        model = f"/api/models/{MODEL_ID}"
        lease_routes = [("POST", f"{model}/lease/renew"), ("DELETE", f"{model}/lease"), ("POST", f"{model}/load"),
                        ("POST", f"{model}/unload"), ("POST", f"{model}/weights/begin"), ("PUT", f"{model}/weights"),
                        ("POST", f"{model}/weights/commit"), ("POST", f"{model}/save"),
                        ("POST", f"/v1/batches/{alpha.batch.id}/lease")]
        model_routes = {route.strip("^$") for route, _ in http_routes() if route.startswith("api/models/<")}
        assert {path.replace(model, "api/models/<path:model_id>").lstrip("/") for _, path in lease_routes
                if path.startswith(model)} == model_routes - {"api/models/<path:model_id>"}
        refused = 0
        for method, path in lease_routes:
            other = alpha.call(method, path, headers={"X-miLLM-Lease": lease})
            unknown = alpha.call(method, path, headers={"X-miLLM-Lease": unknown_lease})
            same_answer(other, unknown, lease, unknown_lease, refused=False)
            refused += other.status_code == 404
        assert refused >= 6  # renew, release, begin, write, commit, save and the hand-over at least
        other = alpha.call("POST", "/v1/batches", json={**create, "input_file_id": alpha.file}, headers={"X-miLLM-Lease": lease})
        unknown = alpha.call("POST", "/v1/batches", json={**create, "input_file_id": alpha.file},
                             headers={"X-miLLM-Lease": unknown_lease})
        same_answer(other, unknown, lease, unknown_lease)
        # None of it acted: the model is still resident with its weights whole, beta's lease still live.
        entry = alpha.call("GET", f"/api/models/{MODEL_ID}").json()["data"]
        assert (entry["state"], entry["weights"]) == ("resident", "clean")
        assert beta.call("GET", f"/api/models/{MODEL_ID}/lease").json()["data"]["holder"] == "beta"
        # Beta's lease still binds alpha, naming its holder, as any lease binds any caller.
        blocked = alpha.call("POST", f"/api/models/{MODEL_ID}/unload")
        assert blocked.status_code == 409 and "beta" in blocked.text
    finally:
        assert beta.call("DELETE", f"/api/models/{MODEL_ID}/lease", headers={"X-miLLM-Lease": lease}).status_code == 200


def test_progress_events_reach_only_the_owner_and_the_admin(tenants):
    import socketio
    import websockets

    alpha, beta, admin = tenants.alpha, tenants.beta, tenants.admin
    ws_url = tenants.web.url.replace("http://", "ws://") + "/ws/batches/"

    async def scenario():
        heard = {"alpha": [], "beta": [], "admin": [], "alpha-sio": [], "admin-sio": []}
        sockets = {name: await websockets.connect(f"{ws_url}?token={tenant.key}")
                   for name, tenant in (("alpha", alpha), ("beta", beta), ("admin", admin))}
        sio = {}
        for name, tenant in (("alpha-sio", alpha), ("admin-sio", admin)):
            client = socketio.AsyncClient()
            client.on("batch:progress", lambda data, name=name: heard[name].append(data["id"]))
            await client.connect(tenants.web.url, transports=["websocket"], auth={"token": tenant.key})
            sio[name] = client

        async def listen(name, socket):
            async for message in socket:
                heard[name].append(json.loads(message)["data"]["id"])

        listeners = [asyncio.create_task(listen(name, socket)) for name, socket in sockets.items()]
        batch = await asyncio.to_thread(start_batch, beta.client, scoring_lines(2, "events"), COMPLETIONS)
        deadline = asyncio.get_running_loop().time() + 60
        while not (heard["beta"].count(batch.id) and heard["admin"].count(batch.id) and heard["admin-sio"].count(batch.id)
                   and (await asyncio.to_thread(beta.client.batches.retrieve, batch.id)).status in FINISHED):
            assert asyncio.get_running_loop().time() < deadline, heard
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # time for any stray event to arrive where it must not
        alpha_follow = await sio["alpha-sio"].call("join", batch.id, timeout=10)
        for task in listeners:
            task.cancel()
        for socket in sockets.values():
            await socket.close()
        for client in sio.values():
            await client.disconnect()
        return heard, batch, alpha_follow

    heard, batch, alpha_follow = asyncio.run(scenario())
    assert batch.id not in heard["alpha"] and batch.id not in heard["alpha-sio"]
    assert batch.id in heard["beta"] and batch.id in heard["admin"] and batch.id in heard["admin-sio"]
    assert alpha_follow["ok"] is False  # joining another project's batch: as an unknown batch


def test_over_a_quota_the_sdk_raises_rate_limit_error_and_nothing_is_stored(tenants):
    alpha = tenants.alpha
    tenants.sql("UPDATE projects_app_project SET max_file_bytes = 10 WHERE name = 'alpha' RETURNING id")
    try:
        before = tenants.sql("SELECT count(*) FROM files_app_file")[0][0]
        with pytest.raises(openai.RateLimitError) as refused:
            alpha.client.files.create(file=("more.jsonl", to_jsonl(scoring_lines(3, "more"))), purpose="batch")
        error = refused.value.body
        assert refused.value.code == "quota_exceeded" and error["details"]["quota"] == "file_bytes"
        assert error["details"]["limit"] == 10 and error["details"]["current"] > 10
        assert tenants.sql("SELECT count(*) FROM files_app_file")[0][0] == before
        # Stored responses count against the same stored-bytes quota; one not stored does not.
        stored = tenants.sql("SELECT count(*), sum(bytes) FROM responses_app_storedresponse WHERE project_id = "
                             "(SELECT id FROM projects_app_project WHERE name = 'alpha')")[0]
        assert stored[0] == 1 and stored[1] > 0
        with pytest.raises(openai.RateLimitError) as refused:
            alpha.client.responses.create(model=MODEL_ID, input="more", max_output_tokens=2)
        assert refused.value.body["details"]["current"] >= error["details"]["current"] > stored[1]
        assert alpha.client.responses.create(model=MODEL_ID, input="more", max_output_tokens=2, store=False).store is False
        assert tenants.sql("SELECT count(*) FROM responses_app_storedresponse WHERE project_id = "
                           "(SELECT id FROM projects_app_project WHERE name = 'alpha')")[0][0] == 1
    finally:
        tenants.sql("UPDATE projects_app_project SET max_file_bytes = NULL WHERE name = 'alpha' RETURNING id")
    wait_until(lambda: alpha.client.files.create(file=("ok.jsonl", to_jsonl(scoring_lines(1, "ok"))), purpose="batch"), 5,
               "the upload was still refused with the quota lifted")


def test_no_key_is_in_the_logs_or_the_database(tenants):
    """After everything above, the three keys appear in no process's log and in no text column
    of any table: only their hashes and hints are stored."""
    keys = [tenants.alpha.key, tenants.beta.key, tenants.admin.key]
    for process in tenants.processes:
        log = process.log()
        assert not [key for key in keys if key in log], process.name
    columns = tenants.sql("SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public' "
                          "AND data_type IN ('text', 'character varying', 'jsonb', 'json')")
    assert len(columns) > 20
    for table, column in columns:
        for key in keys:
            found = tenants.sql(f'SELECT count(*) FROM "{table}" WHERE "{column}"::text LIKE %s', [f"%{key}%"])
            assert found == [(0,)], (table, column)
    hashes = {row[0] for row in tenants.sql("SELECT key_hash FROM projects_app_apikey")}
    assert {hashlib.sha256(key.encode()).hexdigest() for key in keys} <= hashes
