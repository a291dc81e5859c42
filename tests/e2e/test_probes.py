"""Probes: import checked against the resident model, and scores equal a hand computation."""

import httpx
import pytest
import torch

from tests.e2e.conftest import MODEL_ID

D_MODEL = 64  # the tiny test model's width


def probe_body(**overrides):
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(D_MODEL, generator=generator).tolist()
    body = {
        "name": "sentiment", "model": MODEL_ID, "layer": 1, "weights": weights, "bias": 0.25,
        "norm_mean": 0.1, "norm_std": [2.0] * D_MODEL, "aggregation": "mean", "threshold": 0.0,
    }
    return {**body, **overrides}


@pytest.fixture(scope="module")
def probe(stack):
    created = httpx.post(stack.web.url + "/api/probes", json=probe_body())
    assert created.status_code == 201, created.text
    yield created.json()["data"]
    httpx.delete(stack.web.url + f"/api/probes/{created.json()['data']['id']}")


def hand_scores(resident, token_ids, body, prompt_tokens):
    """The SPEC formula, computed here from transformers' hidden_states."""
    with torch.inference_mode():
        states = resident.model(input_ids=torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    hidden = states[body["layer"] + 1][0].float()
    per_token = ((hidden - torch.tensor(body["norm_mean"])) / torch.tensor(body["norm_std"])) @ torch.tensor(body["weights"]) + body["bias"]
    return {"all": per_token.mean().item(), "prompt": per_token[:prompt_tokens].mean().item(),
            "response": per_token[prompt_tokens:].mean().item() if prompt_tokens < len(token_ids) else None}


def test_an_import_that_does_not_fit_names_every_mismatching_field(stack):
    response = httpx.post(stack.web.url + "/api/probes", json=probe_body(weights=[0.5] * 32, layer=7, norm_mean=[0.0] * 3))
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "PROBE_MODEL_MISMATCH"
    mismatches = {m["field"]: m for m in error["details"]["mismatches"]}
    assert mismatches["weights"] == {"field": "weights", "expected": D_MODEL, "actual": 32}
    assert mismatches["layer"]["actual"] == 7 and mismatches["layer"]["expected"] == "0..1"
    assert mismatches["norm_mean"]["actual"] == 3
    assert "weights" in error["message"]


def test_an_import_for_another_model_is_a_mismatch_on_model(stack):
    response = httpx.post(stack.web.url + "/api/probes", json=probe_body(model="some-other-model"))
    assert response.status_code == 409
    assert response.json()["error"]["details"]["mismatches"][0] == {
        "field": "model", "expected": MODEL_ID, "actual": "some-other-model"
    }


def test_a_malformed_import_names_the_field(stack):
    response = httpx.post(stack.web.url + "/api/probes", json=probe_body(aggregation="median", extra=1))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "INVALID_PROBE_REQUEST"
    assert response.json()["error"]["details"]["field"] in ("aggregation", "extra")


def test_probes_are_listed_shown_and_deleted(stack, probe):
    listed = httpx.get(stack.web.url + "/api/probes").json()["data"]
    assert probe["id"] in [item["id"] for item in listed]
    shown = httpx.get(stack.web.url + f"/api/probes/{probe['id']}").json()["data"]
    assert shown["d_model"] == D_MODEL and len(shown["weights"]) == D_MODEL
    extra = httpx.post(stack.web.url + "/api/probes", json=probe_body(name="temporary")).json()["data"]
    assert httpx.delete(stack.web.url + f"/api/probes/{extra['id']}").json()["data"]["deleted"] is True
    missing = httpx.get(stack.web.url + f"/api/probes/{extra['id']}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "PROBE_NOT_FOUND"


def test_probe_scores_equal_a_hand_computation(stack, probe, resident):
    messages = [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Very well, thanks."}]
    token_ids = resident.encode("plain tokens here")
    body = {
        "probe_ids": [probe["id"]],
        "inputs": [{"text": "I loved it."}, {"messages": messages}, {"token_ids": token_ids, "prompt_tokens": 2}],
        "windows": ["all", "prompt", "response"],
        "return_token_ids": True,
    }
    response = httpx.post(stack.web.url + "/api/probes/score", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["X-miLLM-Model"] == MODEL_ID
    payload = response.json()
    assert payload["success"] is True and payload["data"]["model"] == {"id": MODEL_ID}
    results = payload["data"]["results"]
    definition = probe_body()
    for result in results:
        expected = hand_scores(resident, result["token_ids"], definition, result["prompt_tokens"])
        by_window = {verdict["window"]: verdict for verdict in result["verdicts"]}
        assert by_window["all"]["score"] == pytest.approx(expected["all"], abs=1e-4)
        assert by_window["all"]["verdict"] == (by_window["all"]["score"] >= 0.0)
        assert by_window["prompt"]["score"] == pytest.approx(expected["prompt"], abs=1e-4)
        if expected["response"] is None:
            assert by_window["response"]["verdict"] is None and by_window["response"]["not_scored_reason"]
        else:
            assert by_window["response"]["score"] == pytest.approx(expected["response"], abs=1e-4)
    text, chat, ids = results
    assert text["prompt_tokens"] == text["n_tokens"]  # text is all prompt
    assert 0 < chat["prompt_tokens"] < chat["n_tokens"]  # the final assistant turn is the response
    assert ids["prompt_tokens"] == 2 and ids["token_ids"] == token_ids


def test_without_probe_ids_every_probe_of_the_resident_model_scores(stack, probe):
    response = httpx.post(stack.web.url + "/api/probes/score", json={"inputs": [{"text": "hi"}]})
    verdicts = response.json()["data"]["results"][0]["verdicts"]
    assert probe["id"] in [verdict["probe_id"] for verdict in verdicts]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"inputs": [{"text": "a", "token_ids": [1]}]}, "inputs.0"),
        ({"inputs": [{"text": "a"}], "windows": ["middle"]}, "windows.0"),
        ({"inputs": [{"text": "a"}], "model": "x"}, "model"),
        ({"inputs": []}, "inputs"),
        ({"inputs": [{"token_ids": [1, 2], "prompt_tokens": 5}]}, "inputs.0.prompt_tokens"),
        ({"inputs": [{"text": "a"}] * 65}, "inputs"),
    ],
)
def test_a_bad_score_request_names_the_field(stack, body, field):
    response = httpx.post(stack.web.url + "/api/probes/score", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "INVALID_PROBE_SCORE_REQUEST"
    assert error["details"]["field"] == field


def test_a_token_outside_the_vocabulary_is_refused_before_any_forward_pass(stack, probe):
    response = httpx.post(stack.web.url + "/api/probes/score", json={"inputs": [{"token_ids": [10**7]}]})
    assert response.status_code == 400
    assert response.json()["error"]["details"]["field"] == "inputs.0.token_ids"
