"""The management routes' model steps, in-process: registration, the probe check against the
resident model, the engine a load goes to, and the rules for what a request may load."""

import json

import pytest

from inference_app import gateway
from inference_app.catalogue import check_request_may_load
from inference_app.models import Engine, ModelEntry, Probe
from millm_lib.errors import ApiError
from tests.factories import EngineFactory


def post(client, path, body):
    return client.post(path, json.dumps(body), content_type="application/json")


def probe_import(**fields):
    return {"name": "sentiment", "model": "tiny-resident", "layer": 1, "weights": [0.5] * 64,
            "aggregation": "mean", **fields}


@pytest.fixture
def resident_model():
    """A live active engine with a 2-layer, 64-wide model resident."""
    entry = ModelEntry.objects.create(id="tiny-resident", source="/nowhere", source_format="folder",
                                      state="resident", hidden_size=64, num_layers=2)
    EngineFactory(model_id=entry.pk, resident_model_id=entry.pk)
    return entry


@pytest.mark.django_db
def test_a_registered_model_is_created_once_and_its_id_then_refused(client, test_model_dir):
    created = post(client, "/api/models", {"source": str(test_model_dir), "id": "tiny-registered"})
    assert created.status_code == 201 and created.json()["data"]["format"] == "folder"
    again = post(client, "/api/models", {"source": str(test_model_dir), "id": "tiny-registered"})
    assert again.status_code == 409 and again.json()["error"]["code"] == "MODEL_EXISTS"


@pytest.mark.django_db
def test_a_probe_that_fits_the_resident_model_is_imported(client, resident_model):
    answer = post(client, "/api/probes", probe_import(norm_std=[1.0] * 64))
    assert answer.status_code == 201
    probe = Probe.objects.get(pk=answer.json()["data"]["id"])
    assert probe.model_id == "tiny-resident" and probe.norm_mean == 0.0 and len(probe.norm_std) == 64


@pytest.mark.django_db
def test_a_probe_that_does_not_fit_is_refused_naming_every_field(client, resident_model):
    answer = post(client, "/api/probes", probe_import(model="tiny-other", layer=2, weights=[0.5] * 3))
    assert answer.status_code == 409
    mismatches = answer.json()["error"]["details"]["mismatches"]
    assert [m["field"] for m in mismatches] == ["model", "layer", "weights"]
    assert mismatches[1]["expected"] == "0..1" and mismatches[2]["expected"] == 64


@pytest.mark.django_db
def test_without_a_resident_model_a_probe_import_is_503(client):
    answer = post(client, "/api/probes", probe_import())
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "MODEL_NOT_LOADED"


@pytest.mark.django_db
def test_probes_of_two_models_are_refused_for_scoring_together(resident_model):
    first = Probe.objects.create(id="probe_a", name="a", model_id="tiny-resident", layer=0, weights=[0.0],
                                 norm_mean=0.0, norm_std=1.0, aggregation="mean")
    Probe.objects.create(id="probe_b", name="b", model_id="tiny-other", layer=0, weights=[0.0],
                         norm_mean=0.0, norm_std=1.0, aggregation="mean")
    assert Probe.objects.model_of([first.pk]) == "tiny-resident"
    with pytest.raises(ApiError) as refused:
        Probe.objects.model_of(["probe_a", "probe_b"])
    assert refused.value.code == "invalid_probe_score_request"
    with pytest.raises(ApiError) as unknown:
        Probe.objects.model_of(["probe_missing"])
    assert unknown.value.code == "probe_not_found"


@pytest.mark.django_db
def test_a_load_goes_to_the_engine_named_else_the_one_serving_else_one_started_for_it(resident_model):
    serving = Engine.objects.get(resident_model_id="tiny-resident")
    started_for_other = EngineFactory(model_id="tiny-other")
    assert gateway.engine_to_load("tiny-resident").pk == serving.pk
    assert gateway.engine_to_load("tiny-other").pk == started_for_other.pk
    assert gateway.engine_to_load("tiny-third").pk == started_for_other.pk  # the idle one
    assert gateway.engine_to_load("tiny-resident", started_for_other.pk).pk == started_for_other.pk
    with pytest.raises(ApiError) as missing:
        gateway.engine_to_load("tiny-resident", "eng_gone")
    assert missing.value.status == 404 and missing.value.code == "engine_not_found"


@pytest.mark.django_db
def test_with_no_live_engine_a_load_is_503_engine_unavailable():
    with pytest.raises(ApiError) as refused:
        gateway.engine_to_load("tiny-resident")
    assert refused.value.code == "engine_unavailable"


def test_a_request_never_loads_a_checkpoint_nor_any_model_under_policy_refuse():
    checkpoint = ModelEntry(id="base:ckpt-1", kind=ModelEntry.Kind.CHECKPOINT)
    catalogue = ModelEntry(id="base", kind=ModelEntry.Kind.CATALOGUE)
    with pytest.raises(ApiError) as refused:
        check_request_may_load(checkpoint, "auto", None)
    assert refused.value.code == "model_not_found" and "never loads a checkpoint" in refused.value.message
    with pytest.raises(ApiError) as refused:
        check_request_may_load(catalogue, "refuse", "other")
    assert refused.value.code == "model_not_resident" and "'other'" in refused.value.message
    check_request_may_load(catalogue, "auto", None)
