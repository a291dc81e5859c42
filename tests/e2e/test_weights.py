"""Weights: edits, saves, checkpoints and the torn state (SPEC 5, "Weights"), on a stack of their
own: these tests change and rename the resident model, which would disturb the shared stack."""

import signal
import time

import httpx
import pytest
import safetensors.torch
import torch

from tests.e2e.batch_helpers import line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.model_helpers import api, resident, wait_resident
from tests.e2e.stack import Stack, wait_until

COMPLETIONS = "/v1/completions"
CKPT = f"{MODEL_ID}:ckpt-"
PROMPT = "The weights of a model"


@pytest.fixture(scope="module")
def lab(tmp_path_factory, test_model_dir):
    with Stack.running(
        tmp_path_factory.mktemp("weights"), test_model_dir, BATCH_TEST_PAUSE_BEFORE_RECORD_S=0.3, BATCH_WAIT_POLL_S=0.2
    ) as stack:
        stack.client = make_client(stack.web.url)
        yield stack


def engine_weights(stack):
    engines = [e for e in stack.engines(stack.web) if e["alive"] and e["role"] == "active"]
    return engines[0]["weights"]


def load(stack, model_id, lease=None):
    answer = api(stack, "POST", f"/api/models/{model_id}/load", lease=lease)
    assert answer.status_code == 202, answer.text
    wait_resident(stack, model_id)


def score(stack, model_id):
    """A scoring request's answer (status, body): the top five logprobs of the next token."""
    answer = httpx.post(
        stack.web.url + COMPLETIONS,
        json={"model": model_id, "prompt": PROMPT, "max_tokens": 1, "logprobs": 5},
        timeout=60,
    )
    return answer.status_code, answer.json()


def top_logprobs(stack, model_id):
    status, body = score(stack, model_id)
    assert status == 200, body
    return body["choices"][0]["logprobs"]["top_logprobs"]


def norm_edit(value=None):
    """A safetensors body that overwrites the final norm of the tiny model (hidden size 64)."""
    generator = torch.Generator().manual_seed(11)
    tensor = value if value is not None else torch.rand(64, generator=generator) * 4
    return safetensors.torch.save({"model.norm.weight": tensor})


def edit(stack, body, lease=None):
    for step, method, path, kwargs in (
        ("begin", "POST", "weights/begin", {}),
        ("write", "PUT", "weights", {"content": body}),
        ("commit", "POST", "weights/commit", {}),
    ):
        answer = api(stack, method, f"/api/models/{resident(stack)}/{path}", lease=lease, **kwargs)
        assert answer.status_code == 200, (step, answer.text)
    return answer.json()["data"]


@pytest.fixture
def home(lab):
    """Each test starts with the engine's own model resident, clean, and no lease."""
    current = resident(lab)
    if engine_weights(lab) == "torn":
        assert api(lab, "POST", f"/api/models/{current}/weights/commit").status_code == 200
    if current != MODEL_ID:
        load(lab, MODEL_ID)
    return lab


def test_an_edit_changes_the_next_response_and_its_checkpoint_reproduces_it(home):
    before = top_logprobs(home, MODEL_ID)
    begun = api(home, "POST", f"/api/models/{MODEL_ID}/weights/begin")
    assert begun.json()["data"] == {"model": MODEL_ID, "weights": "torn"}
    status, body = score(home, MODEL_ID)
    assert status == 409 and body["error"]["code"] == "weights_torn"
    written = api(home, "PUT", f"/api/models/{MODEL_ID}/weights", content=norm_edit())
    assert written.json()["data"]["written"] == ["model.norm.weight"]
    assert api(home, "POST", f"/api/models/{MODEL_ID}/weights/commit").json()["data"]["weights"] == "clean"
    edited = top_logprobs(home, MODEL_ID)
    assert edited != before

    saved = api(home, "POST", f"/api/models/{MODEL_ID}/save")
    assert saved.status_code == 201, saved.text
    checkpoint = saved.json()["data"]["model"]
    assert checkpoint.startswith(CKPT) and saved.json()["data"]["renamed_from"] == MODEL_ID
    assert (home.data_dir / "checkpoints").exists()
    assert resident(home) == checkpoint
    assert top_logprobs(home, checkpoint) == edited
    listed = [m["id"] for m in httpx.get(home.web.url + "/v1/models").json()["data"]]
    assert checkpoint in listed and MODEL_ID not in listed

    # The catalogue id the save renamed: 404, naming the resident id to send; nothing loads.
    status, body = score(home, MODEL_ID)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert f"'{checkpoint}'" in body["error"]["message"]
    assert resident(home) == checkpoint

    # Back to the base: its own weights; the checkpoint is never auto-loaded.
    load(home, MODEL_ID)
    assert top_logprobs(home, MODEL_ID) == before
    status, body = score(home, checkpoint)
    assert status == 404 and body["error"]["code"] == "model_not_found" and "never loads a checkpoint" in body["error"]["message"]
    time.sleep(0.5)
    assert resident(home) == MODEL_ID

    # Loading the checkpoint puts its weights over the base: the edited answer, exactly.
    load(home, checkpoint)
    assert top_logprobs(home, checkpoint) == edited
    entry = api(home, "GET", f"/api/models/{checkpoint}").json()["data"]
    assert (entry["kind"], entry["base"], entry["state"]) == ("checkpoint", MODEL_ID, "resident")


def test_a_write_is_checked_whole_and_refused_naming_each_mismatch(home):
    before = top_logprobs(home, MODEL_ID)
    unbegun = api(home, "PUT", f"/api/models/{MODEL_ID}/weights", content=norm_edit())
    assert unbegun.status_code == 409 and unbegun.json()["error"]["code"] == "WEIGHTS_NOT_BEGUN"
    assert api(home, "POST", f"/api/models/{MODEL_ID}/weights/begin").status_code == 200
    mixed = safetensors.torch.save({
        "model.norm.weight": torch.ones(65),
        "model.no_such.weight": torch.ones(3),
        "model.layers.0.input_layernorm.weight": torch.zeros(64),
    })
    refused = api(home, "PUT", f"/api/models/{MODEL_ID}/weights", content=mixed)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "INVALID_WEIGHTS_REQUEST"
    assert "'model.norm.weight': expected [64], got [65]" in error["message"]
    assert "'model.no_such.weight': no such tensor" in error["message"]
    assert {m["name"] for m in error["details"]["mismatches"]} == {"model.norm.weight", "model.no_such.weight"}
    garbage = api(home, "PUT", f"/api/models/{MODEL_ID}/weights", content=b"not a safetensors file")
    assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "INVALID_WEIGHTS_REQUEST"
    assert api(home, "POST", f"/api/models/{MODEL_ID}/weights/commit").status_code == 200
    # The layer-norm zeros beside the bad tensors were not written either.
    assert top_logprobs(home, MODEL_ID) == before
    assert list((home.data_dir / "weights-uploads").iterdir()) == []


def test_a_lease_held_by_another_refuses_begin_write_commit_and_save(home):
    granted = api(home, "POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "alice", "reason": "editing"})
    lease = granted.json()["data"]["id"]
    steps = (
        ("POST", "weights/begin", {}, 200),
        ("PUT", "weights", {"content": norm_edit(torch.full((64,), 0.5))}, 200),
        ("POST", "weights/commit", {}, 200),
        ("POST", "save", {}, 201),
    )
    for method, path, kwargs, status in steps:
        refused = api(home, method, f"/api/models/{MODEL_ID}/{path}", **kwargs)
        assert refused.status_code == 409, (path, refused.text)
        assert refused.json()["error"]["code"] == "MODEL_LEASED" and "alice" in refused.json()["error"]["message"]
        allowed = api(home, method, f"/api/models/{MODEL_ID}/{path}", lease=lease, **kwargs)
        assert allowed.status_code == status, (path, allowed.text)
    checkpoint = allowed.json()["data"]["model"]
    # The lease follows the weights to their new id; the holder releases it there.
    assert api(home, "GET", f"/api/models/{checkpoint}/lease").json()["data"]["holder"] == "alice"
    assert api(home, "DELETE", f"/api/models/{checkpoint}/lease", lease=lease).status_code == 200


def test_batch_lines_resolve_like_the_synchronous_routes(home):
    saved = api(home, "POST", f"/api/models/{MODEL_ID}/save").json()["data"]["model"]
    older = f"{CKPT}1"
    assert saved != older  # an earlier test saved ckpt-1; it is not resident now
    lines = [
        line("renamed", COMPLETIONS, {"model": MODEL_ID, "prompt": "a", "max_tokens": 1, "logprobs": 1}),
        line("not-resident", COMPLETIONS, {"model": older, "prompt": "b", "max_tokens": 1, "logprobs": 1}),
        line("resident", COMPLETIONS, {"model": saved, "prompt": "c", "max_tokens": 1, "logprobs": 1}),
    ]
    for name, expected in ((MODEL_ID, 404), (older, 404), (saved, 200)):
        assert score(home, name)[0] == expected
    done = wait_for(home.client, start_batch(home.client, lines, COMPLETIONS).id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 1, 2)
    errors = {row["custom_id"]: row["error"] for row in read_jsonl(home.client, done.error_file_id)}
    assert errors["renamed"]["code"] == "model_not_found" and f"'{saved}'" in errors["renamed"]["message"]
    assert errors["not-resident"]["code"] == "model_not_found" and "never loads a checkpoint" in errors["not-resident"]["message"]
    assert [row["custom_id"] for row in read_jsonl(home.client, done.output_file_id)] == ["resident"]
    assert resident(home) == saved


def test_batch_lines_after_a_checkpoint_load_resolve_like_the_synchronous_routes(home):
    """The rename by a checkpoint load, as the save's above: once `load(checkpoint)` made the
    resident weights the checkpoint's, the base id they came from stops resolving to them."""
    checkpoint = api(home, "POST", f"/api/models/{MODEL_ID}/save").json()["data"]["model"]
    load(home, MODEL_ID)
    load(home, checkpoint)
    assert resident(home) == checkpoint
    status, body = score(home, MODEL_ID)
    assert status == 404 and body["error"]["code"] == "model_not_found" and f"'{checkpoint}'" in body["error"]["message"]
    lines = [
        line("base", COMPLETIONS, {"model": MODEL_ID, "prompt": "a", "max_tokens": 1, "logprobs": 1}),
        line("checkpoint", COMPLETIONS, {"model": checkpoint, "prompt": "b", "max_tokens": 1, "logprobs": 1}),
    ]
    done = wait_for(home.client, start_batch(home.client, lines, COMPLETIONS).id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 1, 1)
    assert done.model == checkpoint
    errors = {row["custom_id"]: row["error"] for row in read_jsonl(home.client, done.error_file_id)}
    assert errors["base"]["code"] == "model_not_found" and f"'{checkpoint}'" in errors["base"]["message"]
    assert errors["base"]["message"] == f"Line 1: {body['error']['message']}"
    assert [row["custom_id"] for row in read_jsonl(home.client, done.output_file_id)] == ["checkpoint"]
    assert resident(home) == checkpoint  # nothing loaded the base for the line that named it


def test_a_batch_waits_weights_torn_without_running_a_row_and_completes_after_the_commit(home):
    lease = api(home, "POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "bob", "reason": "sweep"}).json()["data"]["id"]
    lines = [line(f"row-{i}", COMPLETIONS, {"model": MODEL_ID, "prompt": f"Item {i}:", "max_tokens": 1, "logprobs": 2})
             for i in range(40)]
    batch = start_batch(home.client, lines, COMPLETIONS, extra_headers={"X-miLLM-Lease": lease})
    wait_for(home.client, batch.id, {"in_progress"}, check=lambda b: b.request_counts.completed >= 8)
    assert api(home, "POST", f"/api/models/{MODEL_ID}/weights/begin", lease=lease).status_code == 200

    def waiting():
        return httpx.get(home.web.url + f"/v1/batches/{batch.id}").json()["millm"]["waiting_reason"] == "weights_torn"

    wait_until(waiting, 30, "the batch did not wait weights_torn", home.engine)
    recorded = home.sql("SELECT count(*) FROM batches_app_batchrow WHERE batch_id = %s AND outcome <> 'pending'", [batch.id])
    time.sleep(2)
    assert home.sql("SELECT count(*) FROM batches_app_batchrow WHERE batch_id = %s AND outcome <> 'pending'", [batch.id]) == recorded
    assert recorded[0][0] < 40
    assert api(home, "POST", f"/api/models/{MODEL_ID}/weights/commit", lease=lease).status_code == 200
    done = wait_for(home.client, batch.id, timeout=120)
    assert (done.status, done.request_counts.completed) == ("completed", 40)
    api(home, "DELETE", f"/api/models/{MODEL_ID}/lease", lease=lease)


def test_an_engine_killed_while_torn_comes_back_torn_until_a_late_commit(home):
    assert api(home, "POST", f"/api/models/{MODEL_ID}/weights/begin").status_code == 200
    killed = home.engine_id(MODEL_ID)
    home.engine.popen.send_signal(signal.SIGKILL)
    home.engine.popen.wait()
    home.engine = home.start_engine()

    def came_back():
        return any(e["id"] != killed and e["alive"] and e["role"] == "active" and e["resident_model"] == MODEL_ID
                   for e in home.engines(home.web))

    wait_until(came_back, 60, "the engine did not come back", home.engine)
    assert engine_weights(home) == "torn"
    status, body = score(home, MODEL_ID)
    assert status == 409 and body["error"]["code"] == "weights_torn"
    committed = api(home, "POST", f"/api/models/{MODEL_ID}/weights/commit")
    assert committed.status_code == 200 and committed.json()["data"]["weights"] == "clean"
    assert engine_weights(home) == "clean"
    assert score(home, MODEL_ID)[0] == 200
