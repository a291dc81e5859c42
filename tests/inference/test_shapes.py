"""Every body the server builds fits its shape exactly: each declared key is sent with a value of
its type, and no key is sent that the shape (and so /api/schema/) does not declare."""

import typing

import pytest
from pydantic import TypeAdapter
from typing_extensions import is_typeddict

from batches_app.shapes import BatchList, BatchObject
from files_app.shapes import FileList, FileObject
from inference_app import shapes
from inference_app.engine import services
from inference_app.models import ModelEntry, Probe
from inference_app.schemas import parse_request
from millm_lib.errors import ApiError
from millm_lib.limits import CHAT, COMPLETIONS, EMBEDDINGS, PROBE_SCORE
from millm_lib.shapes import ManagementError, ManagementSuccess, OpenAIError
from tests.factories import BatchFactory, EngineFactory, FileFactory, LeaseFactory


def undeclared_keys(shape, body, where="body"):
    """The keys of `body`, nested shapes included, that `shape` does not declare."""
    hints = typing.get_type_hints(shape)
    found = [f"{where}.{key}" for key in body if key not in hints]
    for key, value in body.items():
        for nested in _shapes_in(hints.get(key)):
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, dict):
                    found += undeclared_keys(nested, item, f"{where}.{key}")
    return found


def _shapes_in(hint):
    if is_typeddict(hint):
        yield hint
    for argument in typing.get_args(hint):
        yield from _shapes_in(argument)


def assert_fits(shape, body):
    TypeAdapter(shape).validate_python(body)
    assert undeclared_keys(shape, body) == []


def parsed(resident, endpoint, **body):
    return parse_request(endpoint, {"model": resident.model_id, **body}, strict=True)


CHAT_BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@pytest.mark.parametrize("endpoint, body, shape", [
    (CHAT, CHAT_BODY, shapes.ChatCompletion),
    (CHAT, {**CHAT_BODY, "max_tokens": 1, "logprobs": True, "top_logprobs": 2}, shapes.ChatCompletion),
    (COMPLETIONS, {"prompt": ["Hi", "Yo"], "max_tokens": 2}, shapes.Completion),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1, "logprobs": 2}, shapes.Completion),
    (EMBEDDINGS, {"input": ["a", "b"]}, shapes.EmbeddingList),
    (EMBEDDINGS, {"input": "a", "encoding_format": "base64"}, shapes.EmbeddingList),
])
def test_an_answer_fits_its_shape(resident, endpoint, body, shape):
    assert_fits(shape, services.run(resident, parsed(resident, endpoint, **body)).body)


@pytest.mark.parametrize("endpoint, body, shape", [
    (CHAT, CHAT_BODY, shapes.ChatCompletionChunk),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 3}, shapes.CompletionChunk),
])
def test_every_chunk_of_a_stream_fits_its_shape(resident, endpoint, body, shape):
    request = parsed(resident, endpoint, **body, stream=True, stream_options={"include_usage": True})
    _, chunks = services.stream(resident, request)
    chunks = list(chunks)
    for chunk in chunks:
        assert_fits(shape, chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_a_probe_score_fits_its_shape_scored_or_not(resident):
    spec = {"id": "probe_1", "name": "p", "layer": 0, "weights": [0.1] * resident.hidden_size, "bias": 0.0,
            "norm_mean": 0.0, "norm_std": 1.0, "aggregation": "mean", "threshold": 0.0}
    request = parse_request(PROBE_SCORE, {"inputs": [{"text": "Hi there"}], "windows": ["all", "response"],
                                          "return_token_ids": True}, strict=True)
    body = services.run(resident, request, probes=[spec]).body
    assert_fits(ManagementSuccess, body)
    assert_fits(shapes.ProbeScores, body["data"])
    assert [verdict.get("not_scored_reason") for verdict in body["data"]["results"][0]["verdicts"]] == [
        None, "the input has no response tokens"]


def test_both_error_envelopes_fit_their_shapes():
    error = ApiError(409, "model_leased", "Held", param="model")
    assert_fits(OpenAIError, error.body())
    assert_fits(ManagementError, error.management_body())


@pytest.mark.django_db
def test_the_stored_objects_fit_their_shapes():
    entry = ModelEntry.objects.create(id="tiny-shape", source="/nowhere", source_format="folder", hidden_size=4)
    engine = EngineFactory(model_id=entry.pk, resident_model_id=entry.pk)
    probe = Probe.objects.create(id="probe_s", name="p", model_id=entry.pk, layer=0, weights=[0.1] * 4,
                                 norm_mean=0.0, norm_std=[1.0] * 4, aggregation="max")
    batch = BatchFactory(errors=[{"code": "invalid_json", "line": 2, "message": "Not JSON"}])
    for shape, body in [
        (shapes.ModelObject, entry.to_openai()),
        (shapes.CatalogueEntry, entry.to_management()),
        (shapes.EngineHealth, engine.to_health()),
        (shapes.LeaseStatus, LeaseFactory(model_id=entry.pk).status()),
        (shapes.ProbeSummary, probe.summary()),
        (shapes.ProbeDetail, probe.detail()),
        (FileObject, FileFactory().to_openai()),
        (BatchObject, batch.to_openai()),
    ]:
        assert_fits(shape, body)


@pytest.mark.django_db
def test_the_health_and_list_answers_fit_their_shapes(client):
    BatchFactory()
    for path, shape in [("/api/health", shapes.Health), ("/api/health/detailed", shapes.HealthDetailed),
                        ("/v1/models", shapes.ModelList)]:
        assert_fits(shape, client.get(path).json())
    assert_fits(FileList, client.get("/v1/files").json())
    assert_fits(BatchList, client.get("/v1/batches").json())
