"""Registering, loading and unloading models, the load policy, and leases, on a stack of their own
(these tests swap the engine's model, which would disturb the shared stack)."""

import time

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.model_helpers import api, resident, wait_resident
from tests.e2e.stack import Stack, wait_until

OTHER = "tiny-two"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def life(tmp_path_factory, test_model_dir):
    with Stack.running(tmp_path_factory.mktemp("life"), test_model_dir) as stack:
        registered = httpx.post(stack.web.url + "/api/models", json={"source": str(test_model_dir), "id": OTHER})
        assert registered.status_code == 201, registered.text
        yield stack


@pytest.fixture
def home(life):
    """Each test starts with the engine's own model resident and no lease."""
    if resident(life) != MODEL_ID:
        assert api(life, "POST", f"/api/models/{MODEL_ID}/load").status_code in (202, 409)
        wait_resident(life, MODEL_ID)
    return life


def test_a_registered_model_is_listed_available(home):
    listed = {m["id"]: m for m in httpx.get(home.web.url + "/v1/models").json()["data"]}
    assert listed[OTHER]["millm"] == {"kind": "catalogue", "state": "available"}
    assert listed[MODEL_ID]["millm"]["state"] == "resident"
    make_client(home.web.url).models.list()  # the SDK still parses it strictly


def test_registering_twice_or_a_missing_source_is_refused(home, tmp_path):
    again = api(home, "POST", "/api/models", json={"source": str(home.model_dir), "id": OTHER})
    assert again.status_code == 409 and again.json()["error"]["code"] == "MODEL_EXISTS"
    missing = api(home, "POST", "/api/models", json={"source": str(tmp_path / "nothing.gguf")})
    assert missing.status_code == 400
    assert missing.json()["error"]["code"] == "INVALID_MODEL_REQUEST"
    assert missing.json()["error"]["details"]["field"] == "source"


def test_refuse_policy_answers_409_naming_the_resident_model_and_loads_nothing(home):
    client = make_client(home.web.url)
    with pytest.raises(openai.ConflictError) as caught:
        client.chat.completions.create(
            model=OTHER, messages=MESSAGES, max_tokens=2, extra_headers={"X-miLLM-Load-Policy": "refuse"}
        )
    assert caught.value.code == "model_not_resident"
    assert f"'{MODEL_ID}'" in caught.value.message
    time.sleep(0.5)
    assert resident(home) == MODEL_ID
    assert "loaded tiny-two" not in home.engine.log()


def test_a_request_naming_a_catalogue_model_loads_it(home):
    raw = make_client(home.web.url).chat.completions.with_raw_response.create(model=OTHER, messages=MESSAGES, max_tokens=2)
    assert raw.parse().model == OTHER
    assert raw.headers["X-miLLM-Model"] == OTHER
    assert resident(home) == OTHER
    states = {m["id"]: m["millm"]["state"] for m in httpx.get(home.web.url + "/v1/models").json()["data"]}
    assert states == {OTHER: "resident", MODEL_ID: "available"}


def test_load_and_unload_answer_202_and_change_the_resident_model(home):
    loading = api(home, "POST", f"/api/models/{OTHER}/load")
    assert loading.status_code == 202
    assert loading.json()["data"]["engine"] == home.engine_id(MODEL_ID)
    assert loading.json()["data"]["model"]["id"] == OTHER
    wait_resident(home, OTHER)
    unloading = api(home, "POST", f"/api/models/{OTHER}/unload")
    assert unloading.status_code == 202
    wait_until(lambda: resident(home) is None, 30, "the model was not unloaded")
    assert httpx.get(home.web.url + "/api/health/detailed").json()["model_loaded"] is False


def test_a_lease_blocks_another_callers_load_and_lets_the_holder_load(home):
    taken = api(home, "POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "alice", "reason": "probing", "ttl_seconds": 120})
    assert taken.status_code == 201
    lease_id = taken.json()["data"]["id"]

    status = api(home, "GET", f"/api/models/{MODEL_ID}/lease").json()["data"]
    assert status["holder"] == "alice" and "id" not in status
    detailed = httpx.get(home.web.url + "/api/health/detailed").json()
    assert detailed["lease"]["holder"] == "alice" and lease_id not in str(detailed)
    assert detailed["lease"]["ttl_seconds"] == 120

    blocked = api(home, "POST", f"/api/models/{OTHER}/load")
    assert blocked.status_code == 409
    error = blocked.json()["error"]
    assert error["code"] == "MODEL_LEASED"
    assert "alice" in error["message"] and "probing" in error["message"] and "until" in error["message"]
    assert lease_id not in error["message"]

    with pytest.raises(openai.ConflictError) as caught:
        make_client(home.web.url).chat.completions.create(model=OTHER, messages=MESSAGES, max_tokens=2)
    assert caught.value.code == "model_leased"

    # A lease never blocks requests to the leased model itself.
    assert make_client(home.web.url).chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=2).choices

    assert api(home, "POST", f"/api/models/{OTHER}/load", lease=lease_id).status_code == 202
    wait_resident(home, OTHER)
    # The lease ended when its model stopped being resident.
    renewed = api(home, "POST", f"/api/models/{MODEL_ID}/lease/renew", lease=lease_id)
    assert renewed.status_code == 409
    assert renewed.json()["error"]["code"] == "LEASE_EXPIRED"
    assert "swapped" in renewed.json()["error"]["message"]


def test_a_lease_expires_on_time(home):
    taken = api(home, "POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "bob", "reason": "short", "ttl_seconds": 1})
    status = taken.json()["data"]
    assert status["expires_at"] - status["acquired_at"] == 1
    assert api(home, "POST", f"/api/models/{OTHER}/load").status_code == 409
    time.sleep(1.2)
    assert api(home, "GET", f"/api/models/{MODEL_ID}/lease").json()["data"] is None
    assert api(home, "POST", f"/api/models/{OTHER}/load").status_code == 202
    wait_resident(home, OTHER)


def test_renew_and_release_need_the_lease_id(home):
    taken = api(home, "POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "carol", "reason": "renewing", "ttl_seconds": 60})
    lease_id = taken.json()["data"]["id"]
    second = api(home, "POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "dan", "reason": "me too"})
    assert second.status_code == 409 and "carol" in second.json()["error"]["message"]

    assert api(home, "POST", f"/api/models/{MODEL_ID}/lease/renew").status_code == 400
    unknown = api(home, "POST", f"/api/models/{MODEL_ID}/lease/renew", lease="lease_" + "0" * 40)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "LEASE_NOT_FOUND"
    malformed = api(home, "POST", f"/api/models/{MODEL_ID}/lease/renew", lease="nope")
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "INVALID_LEASE_REQUEST"

    time.sleep(1.1)
    renewed = api(home, "POST", f"/api/models/{MODEL_ID}/lease/renew", lease=lease_id).json()["data"]
    assert renewed["renewed_at"] > renewed["acquired_at"]
    assert renewed["expires_at"] == renewed["renewed_at"] + 60

    assert api(home, "DELETE", f"/api/models/{MODEL_ID}/lease", lease=lease_id).status_code == 200
    assert api(home, "GET", f"/api/models/{MODEL_ID}/lease").json()["data"] is None


def test_a_bad_lease_body_names_the_field(home):
    response = api(home, "POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "", "reason": "x", "ttl_seconds": 9000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "INVALID_LEASE_REQUEST"
    assert error["details"]["field"] in ("holder", "ttl_seconds")


def test_an_engine_restart_ends_every_lease(home):
    taken = api(home, "POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "erin", "reason": "restart", "ttl_seconds": 600})
    lease_id = taken.json()["data"]["id"]
    crashed = home.engine_id(MODEL_ID)
    home.engine.kill()  # a crash: nothing ran on the way out
    home.engine = home.start_engine()

    def restarted():
        return any(e["alive"] and e["role"] == "active" and e["model"] == MODEL_ID and e["id"] != crashed
                   for e in home.engines(home.web))

    wait_until(restarted, 60, "the engine did not come back", home.engine)
    assert api(home, "GET", f"/api/models/{MODEL_ID}/lease").json()["data"] is None
    renewed = api(home, "POST", f"/api/models/{MODEL_ID}/lease/renew", lease=lease_id)
    assert renewed.status_code == 404 and renewed.json()["error"]["code"] == "LEASE_NOT_FOUND"


def test_load_and_unload_send_model_events_to_socketio_clients(home):
    import asyncio

    import socketio

    async def scenario():
        seen = []
        client = socketio.AsyncClient()
        for name in ("model:load:progress", "model:load:complete", "model:load:error", "model:unload:complete"):
            client.on(name, lambda data, name=name: seen.append((name, data)))
        await client.connect(home.web.url, transports=["websocket"])
        answer = await asyncio.to_thread(api, home, "POST", f"/api/models/{OTHER}/load")
        assert answer.status_code == 202, answer.text
        for _ in range(300):
            if any(name == "model:load:complete" for name, _ in seen):
                break
            await asyncio.sleep(0.1)
        await client.disconnect()
        return seen

    seen = asyncio.run(scenario())
    names = [name for name, _ in seen]
    assert names.index("model:load:progress") < names.index("model:unload:complete") < names.index("model:load:complete")
    unloaded = next(data for name, data in seen if name == "model:unload:complete")
    loaded = next(data for name, data in seen if name == "model:load:complete")
    assert unloaded["model_id"] == MODEL_ID and loaded["model_id"] == OTHER and loaded["seconds"] >= 0
