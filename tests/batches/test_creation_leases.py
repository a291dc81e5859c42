"""The create-time lease check is per model (issue 16, point 2): with two engines serving two
models, an outside holder's lease on one refuses only the batches for its own model."""

import pytest

from batches_app.creation import create_batch
from batches_app.models import Batch
from inference_app.models import ModelEntry
from millm_lib.errors import ApiError
from millm_lib.limits import PROBE_SCORE
from tests.factories import EngineFactory, FileFactory, LeaseFactory, requests_of

pytestmark = pytest.mark.django_db

MODEL_A, MODEL_B = "org/model-a", "org/model-b"


@pytest.fixture
def two_engines_two_models():
    for model in (MODEL_A, MODEL_B):
        ModelEntry.objects.create(id=model, source=f"/models/{model}", source_format="folder")
        EngineFactory(model_id=model, resident_model_id=model)


def batch_for(model, endpoint="/v1/completions"):
    lines = requests_of([{"model": model, "prompt": "hi", "max_tokens": 1}] * 2, endpoint)
    body = {"input_file_id": FileFactory(lines=lines).id, "endpoint": endpoint, "completion_window": "24h"}
    return create_batch(body)


def test_a_lease_on_one_model_refuses_only_that_models_batches(two_engines_two_models):
    LeaseFactory(model_id=MODEL_A)

    with pytest.raises(ApiError) as refused:
        batch_for(MODEL_A)
    assert (refused.value.status, refused.value.code) == (409, "model_leased")
    assert MODEL_A in refused.value.message

    created = batch_for(MODEL_B)
    assert Batch.objects.get(pk=created.pk).status == Batch.Status.VALIDATING
    assert Batch.objects.count() == 1  # the refused one stored nothing


def test_the_servers_own_batch_leases_refuse_nothing(two_engines_two_models):
    LeaseFactory(model_id=MODEL_A, holder="millm-batch:batch_0123456789abcdef01234567")
    assert batch_for(MODEL_A).status == Batch.Status.VALIDATING


def test_a_batch_naming_no_model_is_refused_by_any_outside_lease(two_engines_two_models):
    LeaseFactory(model_id=MODEL_B)
    lines = requests_of([{"inputs": ["x"], "probe_ids": ["probe_x"]}], PROBE_SCORE)
    body = {"input_file_id": FileFactory(lines=lines).id, "endpoint": PROBE_SCORE, "completion_window": "24h"}
    with pytest.raises(ApiError) as refused:
        create_batch(body)
    assert refused.value.code == "model_leased"
