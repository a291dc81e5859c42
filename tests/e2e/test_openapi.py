"""The OpenAPI schema at /api/schema/ covers every route, and schemathesis fuzzes a live server
from it: no 5xx, and every response matches the schema.

The fuzzed server is a stack of its own (a database, one engine with the tiny model, one web
process), so nothing it creates or refuses disturbs the shared `stack` of the other e2e tests.
"""

import json
import random
import re

import httpx
import pytest
import schemathesis
from django.test import Client, override_settings
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.resolvers import RoutePattern
from drf_spectacular.validation import validate_schema
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.e2e.stack import Stack

MODEL_ID = "tiny-llama"
# HEAD and OPTIONS are the frameworks' own (a GET without its body, DRF's metadata), not API operations.
AUTOMATIC_METHODS = {"HEAD", "OPTIONS"}
# The admin is HTML behind a staff login, not part of the API.
NOT_API = ("admin",)
HTTP_METHODS = {"get", "put", "post", "delete", "patch"}


# --- the schema covers every route ---


def resolver_routes(patterns=None, prefix="", namespace=None):
    """(sample URL, route as written) of every route Django resolves, outside the admin."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        if isinstance(entry, URLResolver):
            yield from resolver_routes(entry.url_patterns, prefix + _sample(entry.pattern), entry.namespace or namespace)
        elif isinstance(entry, URLPattern) and namespace not in NOT_API:
            yield "/" + prefix + _sample(entry.pattern), prefix + str(entry.pattern)


def _sample(pattern):
    """A concrete piece of URL that the pattern matches: every parameter becomes `sample`."""
    text = str(pattern)
    if isinstance(pattern, RoutePattern):
        return re.sub(r"<(?:\w+:)?\w+>", "sample", text)
    return re.sub(r"\(\?P<\w+>[^)]*\)", "sample", text).lstrip("^").rstrip("$")


def allowed_methods(client, url):
    """What the route itself says it allows: the Allow header of its 405 to a TRACE."""
    response = client.generic("TRACE", url)
    assert response.status_code == 405, (url, response.status_code, response.content[:300])
    return {method.strip() for method in response["Allow"].split(",") if method.strip()} - AUTOMATIC_METHODS


def template_regex(path):
    return re.compile("^" + re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(path)) + "$")


@pytest.fixture(scope="module")
def generated(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock():  # the key middleware asks the database whether keys exist
        response = Client().get("/api/schema/")
    assert response.status_code == 200, response.content[:500]
    assert response["Content-Type"].startswith("application/json")
    return json.loads(response.content)


def test_the_schema_is_valid_openapi_3_1(generated):
    assert generated["openapi"] == "3.1.0"
    validate_schema(generated)


@pytest.mark.django_db
def test_every_route_and_method_is_in_the_schema(generated):
    client = Client()
    templates = {path: template_regex(path) for path in generated["paths"]}
    matched = set()
    routes = list(resolver_routes())
    assert len(routes) >= 25, routes
    for url, route in routes:
        # A literal path wins over a template that also matches it (/api/probes/score, /api/probes/{probe_id}).
        paths = [url] if url in templates else [path for path, regex in templates.items() if regex.match(url)]
        assert len(paths) == 1, f"route {route!r} ({url}) is documented {len(paths)} times in the schema: {paths}"
        path = paths[0]
        matched.add(path)
        documented = {method.upper() for method in generated["paths"][path] if method in HTTP_METHODS}
        allowed = allowed_methods(client, url)
        assert allowed, route
        assert documented == allowed, f"{route}: the route allows {sorted(allowed)}, the schema has {sorted(documented)}"
    assert matched == set(generated["paths"]), f"documented paths no route serves: {set(generated['paths']) - matched}"


def test_every_operation_documents_its_answers(generated):
    refs = {"v1": "#/components/schemas/OpenAIError", "api": "#/components/schemas/ManagementError"}
    for path, item in generated["paths"].items():
        for method, operation in item.items():
            if method not in HTTP_METHODS:
                continue
            responses = operation["responses"]
            assert any(code.startswith("2") for code in responses), (method, path)
            if path.startswith("/api/health") or path == "/metrics":
                continue  # bare objects; no envelope (SPEC 2)
            envelope = refs[path.strip("/").split("/")[0]]
            for code in ("4XX", "5XX"):
                assert responses[code]["content"]["application/json"]["schema"] == {"$ref": envelope}, (method, path, code)
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if body is not None:
                name = body["schema"]["$ref"].rsplit("/", 1)[-1]
                assert name in generated["components"]["schemas"], (path, name)


def test_the_request_bodies_are_the_pydantic_models_the_views_validate_with(generated):
    from inference_app.schemas import ChatCompletionRequest, ProbeScoreRequest

    components = generated["components"]["schemas"]
    chat = generated["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert chat["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert set(components["ChatCompletionRequest"]["properties"]) == set(ChatCompletionRequest.model_fields)
    assert components["ChatCompletionRequest"]["required"] == ["model", "messages"]
    assert set(components["ProbeScoreRequest"]["properties"]) == set(ProbeScoreRequest.model_fields)
    assert components["ProbeScoreRequest"]["additionalProperties"] is False  # management bodies refuse unknown keys
    assert "$defs" not in json.dumps(generated)  # every nested model is a component
    # What the server cannot honour takes only its neutral value (schemas.NEUTRAL).
    assert components["CompletionRequest"]["properties"]["best_of"]["anyOf"] == [{"const": 1}, {"type": "null"}]
    assert components["ChatCompletionRequest"]["properties"]["n"]["maximum"] == 8  # honoured up to 8 (issue 29)
    assert components["EmbeddingRequest"]["properties"]["dimensions"]["type"] == "null"


def test_every_path_id_documents_how_long_an_id_can_be(generated):
    """A path's ids say their longest (an id column's length; a catalogue id's 255), so that a
    client and the fuzz know it, DRF's routes and the plain ones alike."""
    in_paths = [parameter for item in generated["paths"].values() for method, operation in item.items()
                if method in HTTP_METHODS for parameter in operation.get("parameters", []) if parameter["in"] == "path"]
    lengths = {}
    for parameter in in_paths:
        assert parameter["schema"]["type"] == "string" and parameter["schema"]["minLength"] == 1
        lengths.setdefault(parameter["name"], set()).add(parameter["schema"]["maxLength"])
    assert lengths == {"id": {40}, "probe_id": {40}, "response_id": {40}, "model_id": {255}}


def test_the_documented_lengths_are_the_id_columns_lengths():
    from batches_app.models import Batch
    from files_app.models import File
    from inference_app.models import ModelEntry, Probe
    from millm_lib import ids
    from responses_app.models import StoredResponse
    from webhooks_app.models import WebhookEndpoint

    for model in (Batch, File, Probe, StoredResponse, WebhookEndpoint):  # the objects a path's id names
        assert model._meta.pk.max_length == ids.MAX_LENGTH, model
    assert ModelEntry._meta.pk.max_length == ids.MODEL_ID_MAX_LENGTH


@pytest.mark.django_db
def test_the_schema_needs_a_key_when_keys_are_set_like_every_route_but_health(generated):
    assert generated["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "A key from MILLM_API_KEYS, when it is set",
    }
    assert generated["paths"]["/api/health"]["get"]["security"] == [{}]
    assert "security" not in generated["paths"]["/api/schema/"]["get"]
    with override_settings(MILLM_API_KEYS=["sesame"]):
        refused = Client().get("/api/schema/")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "INVALID_API_KEY"  # the management envelope
        assert Client().get("/api/schema/", HTTP_AUTHORIZATION="Bearer sesame").status_code == 200
        assert Client().get("/api/health").status_code == 200


@pytest.mark.django_db
def test_the_schema_routes_errors_take_the_management_envelope():
    refused = Client().post("/api/schema/")
    assert refused.status_code == 405 and refused["Allow"] == "GET, HEAD, OPTIONS"
    assert refused.json() == {"success": False, "data": None, "error": {
        "code": "METHOD_NOT_ALLOWED", "message": 'Method "POST" not allowed.', "details": {}}}


# --- schemathesis against a live server ---

# Bounded: per operation, MAX_EXAMPLES positive and MAX_EXAMPLES negative examples, derandomized
# (a failure reproduces), no shrinking, no deadline, no example database.
MAX_EXAMPLES = 15
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
INFERENCE = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"}


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory, test_model_dir):
    with Stack.running(tmp_path_factory.mktemp("openapi"), test_model_dir) as stack:
        yield stack


@pytest.fixture(scope="module")
def live_schema(fuzz_stack):
    """The schema as the live server serves it. Loaded from the document rather than with
    `from_url`, which leaves out the operation that served it: GET /api/schema/ is fuzzed too."""
    served = httpx.get(fuzz_stack.web.url + "/api/schema/", timeout=30)
    assert served.status_code == 200, served.text[:500]
    config = schemathesis.Config.from_dict({"base-url": fuzz_stack.web.url})
    return schemathesis.openapi.from_dict(served.json(), config=config)


def steer(case):
    """Half the inference bodies name the resident model (with a short generation), so the fuzz
    reaches the engine instead of stopping at 404 model_not_found; likewise half the GETs of a
    model. Decided from the case itself, so a run repeats. Nothing here changes state: the
    operations that would (load, unload, weights, save, lease) keep their generated ids."""
    rng = random.Random(repr((case.path_parameters, case.body)))
    if case.operation.path in INFERENCE and isinstance(case.body, dict) and rng.random() < 0.5:
        case.body["model"] = MODEL_ID
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(case.body.get(name), int) and not isinstance(case.body[name], bool):
                case.body[name] = min(case.body[name], 8)
        if case.operation.path == "/v1/chat/completions" and not {"max_tokens", "max_completion_tokens"} & set(case.body):
            case.body["max_tokens"] = 8  # the chat default is up to 512 tokens
        if case.operation.path == "/v1/responses" and "max_output_tokens" not in case.body:
            case.body["max_output_tokens"] = 8  # as chat's
    if case.method == "GET" and "model_id" in (case.path_parameters or {}) and rng.random() < 0.5:
        case.path_parameters["model_id"] = MODEL_ID


def fuzz(operation, mode):
    @FUZZ_SETTINGS
    @given(case=operation.as_strategy(mode))
    def run(case):
        steer(case)
        case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)

    try:
        run()
    except Unsatisfiable:
        # Nothing to negate: no parameters, or only path ids whose every negation would not be
        # sent as such (an empty segment changes the route); schemathesis filters those out.
        assert mode is GenerationMode.NEGATIVE, operation.label
        pytest.skip(f"{operation.label}: no negative example can be sent")


def test_fuzz_no_server_error_and_responses_match_the_schema(live_schema, subtests):
    """Every operation of the served schema, positive and negative examples: never a 5xx, and
    the response matches the schema, JSON and server-sent events alike (a stream's every `data:`
    is a chunk or an error envelope, then [DONE]). File content (application/jsonl) has no
    deserializer in schemathesis, so only its status and error envelopes are checked there.

    (schemathesis' own pytest loader, `schemathesis.pytest.from_fixture`, sets a node attribute
    that pytest 9.2 no longer has, so the operations are run as subtests here.)"""
    operations = [result.ok() for result in live_schema.get_all_operations()]
    served = {f"{method.upper()} {path}" for path, item in live_schema.raw_schema["paths"].items() for method in item
              if method in HTTP_METHODS}
    assert {operation.label for operation in operations} == served and len(served) >= 36
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            with subtests.test(msg=f"{operation.label} ({mode.value})"):
                fuzz(operation, mode)


def call(live_schema, path, method, **parts):
    """One explicit case, checked as the fuzz checks its own."""
    case = live_schema[path][method].Case(**parts)
    return case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)


def test_answers_and_streams_match_the_schema(live_schema):
    """The success shapes the fuzz reaches only by chance, each validated against the schema:
    streams event by event, scoring, embeddings in both encodings, the catalogue."""
    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for path, body in (
        ("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 4, "stream": True}),
    ):
        response = call(live_schema, path, "POST", body=body)
        assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
        assert response.content.rstrip().endswith(b"data: [DONE]") and response.content.count(b"data: ") >= 3
    answers = [
        ("/v1/chat/completions", {**chat, "stream": False}),
        ("/v1/chat/completions", {**chat, "max_tokens": 1, "logprobs": True, "top_logprobs": 2}),
        ("/v1/completions", {"model": MODEL_ID, "prompt": ["Hi", "Yo"], "max_tokens": 1, "logprobs": 2}),
        ("/v1/embeddings", {"model": MODEL_ID, "input": ["a", "b"], "encoding_format": "base64"}),
        ("/v1/embeddings", {"model": MODEL_ID, "input": "a", "pooling": "last", "normalize": True}),
    ]
    for path, body in answers:
        assert call(live_schema, path, "POST", body=body).status_code == 200, (path, body)
    for path in ("/v1/models/{model_id}", "/api/models/{model_id}", "/api/models/{model_id}/lease"):
        assert call(live_schema, path, "GET", path_parameters={"model_id": MODEL_ID}).status_code == 200, path
    # The Responses API (issue 30): its events (no [DONE]), a stored response, its input items.
    asked = {"model": MODEL_ID, "input": "Hi", "max_output_tokens": 4}
    streamed = call(live_schema, "/v1/responses", "POST", body={**asked, "stream": True})
    assert streamed.status_code == 200 and streamed.content.count(b"event: response.") >= 6
    created = call(live_schema, "/v1/responses", "POST", body=asked)
    stored = {"response_id": json.loads(created.content)["id"]}
    for path in ("/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items"):
        assert call(live_schema, path, "GET", path_parameters=stored).status_code == 200, path


def test_what_the_fuzz_found_stays_fixed(live_schema):
    """Two 500s schemathesis found, now clear 4xx or answers."""
    # An empty prompt encodes to no tokens: the forward pass failed (500); now a 400 naming it.
    empty = call(live_schema, "/v1/completions", "POST", body={"model": MODEL_ID, "prompt": ""})
    assert empty.status_code == 400
    assert json.loads(empty.content)["error"]["param"] == "prompt"
    # An unused field whose name holds a control character broke the X-miLLM-Ignored-Fields
    # header (500); now it is escaped there.
    ignored = call(live_schema, "/v1/embeddings", "POST", headers={"X-miLLM-Strict": "false"},
                   body={"model": MODEL_ID, "input": "a", "\x1bkey\u00e9": 1})
    assert ignored.status_code == 200
    assert ignored.headers["x-millm-ignored-fields"] == ['"\\\\x1bkey\\\\xe9"']


def test_the_fuzzed_server_is_still_whole(fuzz_stack):
    detailed = httpx.get(fuzz_stack.web.url + "/api/health/detailed", timeout=10).json()
    assert detailed["status"] == "ok" and detailed["model_name"] == MODEL_ID, detailed
    assert fuzz_stack.engine.alive and fuzz_stack.web.alive
    for process in (fuzz_stack.web, fuzz_stack.engine):
        assert "Traceback" not in process.log(), process.log()[-4000:]
