"""The one mapper from a body model's validation errors to the API's refusal (millm_lib/bodies.py),
and the limits the schema documents (every limit a refusal names is in the body's schema)."""

import pytest
from django.conf import settings

from batches_app.shapes import BatchCreate
from millm_lib.bodies import validate_body
from millm_lib.errors import ApiError
from webhooks_app.shapes import EndpointCreate, EndpointUpdate, RotateSecret

BATCH = {"input_file_id": "file_1", "endpoint": "/v1/chat/completions", "completion_window": "24h"}


def refusal(model, body):
    with pytest.raises(ApiError) as caught:
        validate_body(model, body, "invalid_request")
    error = caught.value
    assert (error.status, error.code) == (400, "invalid_request")
    return error.param, error.message


@pytest.mark.parametrize("change, param, says", [
    ({"input_file_id": 5}, "input_file_id", "got 5"),
    ({"endpoint": "/v1/moderations"}, "endpoint", "got '/v1/moderations'"),
    ({"completion_window": "169h"}, "completion_window", "'168h', got '169h'"),
    ({"metadata": {"k" * 65: "v"}}, "metadata", "keys of at most 64"),
    ({"output_expires_after": {"anchor": "created_at", "seconds": 10}}, "output_expires_after.seconds", "3,600 to 2,592,000"),
    ({"output_expires_after": "soon"}, "output_expires_after.anchor", '{"anchor": "created_at"'),
    ({"pack_window": True}, "pack_window", "got true"),
    ({"priority": "high"}, "priority", "Unknown field 'priority'; a batch takes batched_decoding, completion_window"),
])
def test_a_batch_body_is_refused_naming_its_field_the_limit_and_what_was_sent(change, param, says):
    got_param, message = refusal(BatchCreate, {**BATCH, **change})
    assert got_param == param and says in message


def test_an_unknown_field_comes_first_and_a_missing_one_says_it_is_required():
    assert refusal(BatchCreate, {**BATCH, "pack": "yes", "zzz": 1})[0] == "zzz"
    assert refusal(EndpointCreate, {"name": "x", "url": "https://hooks.example.com/"}) == ("event_types", "event_types is required")
    assert refusal(EndpointCreate, ["a list"]) == (None, "The body must be a JSON object")


def test_webhook_refusals_read_as_before_and_an_update_takes_any_field():
    good = {"name": "n", "url": "https://hooks.example.com/x", "event_types": ["batch.completed"]}
    assert refusal(EndpointCreate, {**good, "name": "n" * 300}) == ("name", "name is 300 characters; the limit is 256")
    param, message = refusal(EndpointCreate, {**good, "event_types": ["batch.completed", "nope"]})
    assert param == "event_types.1" and message.startswith("event_types.1 is 'nope': this server sends only batch.")
    assert validate_body(EndpointUpdate, {"name": "new"}, "x").model_dump(exclude_none=True) == {"name": "new"}
    doubled = validate_body(EndpointCreate, {**good, "event_types": ["batch.failed", "batch.failed"]}, "x")
    assert doubled.event_types == ["batch.failed"]
    assert refusal(RotateSecret, {"keep_old_secret_active_for_24_hours": 1})[0] == "keep_old_secret_active_for_24_hours"


def test_the_schema_documents_every_limit_a_refusal_names():
    schema = BatchCreate.model_json_schema()
    window = schema["properties"]["pack_window"]["anyOf"][0]
    assert (window["minimum"], window["maximum"]) == (0, settings.BATCH_PACK_WINDOW_MAX)
    metadata = schema["properties"]["metadata"]["anyOf"][0]
    assert metadata["maxProperties"] == 16 and metadata["propertyNames"]["maxLength"] == 64
    assert metadata["additionalProperties"]["maxLength"] == 512
    assert f"{settings.BATCH_MAX_COMPLETION_WINDOW_HOURS}h" in schema["properties"]["completion_window"]["description"]
    name = EndpointCreate.model_json_schema()["properties"]["name"]
    assert name["maxLength"] == 256
