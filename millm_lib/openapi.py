"""The OpenAPI schema served at /api/schema/ (drf-spectacular, OpenAPI 3.1).

drf-spectacular documents the DRF viewsets (files, batches) itself, from the `extend_schema_view`
decorators below. The other routes are plain Django function views that it cannot see:
`add_plain_views`, a postprocessing hook, walks the URL resolver, reads each view's allowed
methods from its `require_http_methods` decorator, and builds its operations from `PLAIN_VIEWS`:
the pydantic request models the views validate with (`model_json_schema()`, `$defs` moved into
components) and the response shapes documented here. A route with no entry stops schema
generation, so a new route cannot be left out (tests/e2e/test_openapi.py checks it too).

Errors: `/v1` routes answer OpenAI's envelope (`OpenAIError`), `/api` routes the management
envelope (`ManagementError`), health and metrics have none (SPEC 2). The schema needs a bearer key
when MILLM_API_KEYS is set, like every route but health (SPEC 1).
"""

import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from django.core.exceptions import ImproperlyConfigured
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.resolvers import RoutePattern
from drf_spectacular.renderers import OpenApiJsonRenderer2
from drf_spectacular.views import SpectacularJSONAPIView
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_serializer,
    extend_schema_view,
)
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from inference_app import schemas as request_schemas
from millm_lib.limits import EXPIRES_AFTER_MAX_S, EXPIRES_AFTER_MIN_S

REF = "#/components/schemas/{model}"


class Shape(BaseModel):
    """A documented response object; keys beyond the declared ones may be added later."""

    model_config = ConfigDict(extra="allow")


# --- errors ---


class OpenAIErrorBody(Shape):
    message: str
    type: Literal["invalid_request_error", "server_error", "rate_limit_error", "authentication_error"]
    param: str | None
    code: str | None


class OpenAIError(Shape):
    """Every /v1 error, framework errors included (SPEC 2)."""

    error: OpenAIErrorBody


class ManagementErrorBody(Shape):
    code: Annotated[str, Field(pattern=r"^[A-Z0-9_]+$")]
    message: str
    details: dict[str, Any]


class ManagementError(Shape):
    """Every /api error (SPEC 2)."""

    success: Literal[False]
    data: None
    error: ManagementErrorBody


# --- /v1 inference ---


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Shape):
    content: list[TokenLogprob]
    refusal: None


class AssistantMessage(Shape):
    role: Literal["assistant"]
    content: str
    refusal: None


class ChatChoice(Shape):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(Shape):
    id: Annotated[str, Field(pattern=r"^chatcmpl-")]
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Shape):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Shape):
    index: int
    delta: ChatDelta
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(Shape):
    id: Annotated[str, Field(pattern=r"^chatcmpl-")]
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(Shape):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(Shape):
    id: Annotated[str, Field(pattern=r"^cmpl-")]
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(Shape):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length"] | None


class CompletionChunk(Shape):
    id: Annotated[str, Field(pattern=r"^cmpl-")]
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class Embedding(Shape):
    object: Literal["embedding"]
    index: int
    # float: a list of numbers; base64: little-endian float32 bytes.
    embedding: Union[list[float], str]


class EmbeddingUsage(Shape):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Shape):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelMillm(Shape):
    kind: Literal["catalogue", "checkpoint"]
    state: Literal["available", "loading", "resident", "unloading", "error"]


class ModelObject(Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    millm: ModelMillm


class ModelList(Shape):
    object: Literal["list"]
    data: list[ModelObject]


# --- health ---


class Health(Shape):
    status: Literal["ok"]
    version: str
    timestamp: int


class LeaseStatus(Shape):
    model_id: str
    holder: str
    reason: str
    acquired_at: int
    renewed_at: int
    expires_at: int
    ttl_seconds: int
    seconds_remaining: int


class EngineHealth(Shape):
    id: str
    alive: bool
    last_heartbeat: int
    model: str | None
    role: Literal["active", "standby"]
    resident_model: str | None
    loading_model: str | None
    weights: Literal["clean", "torn"]


class InferenceHealth(Shape):
    backend: Literal["serial", "batched"]
    queue_pending: int
    queue_max_concurrent: int
    queue_max_pending: int
    in_flight: int
    queue_waiting: int
    estimated_wait_seconds: float | None
    batch_backlog_rows: int | None


class HealthDetailed(Shape):
    status: Literal["ok", "degraded"]
    version: str
    timestamp: int
    model_loaded: bool
    model_name: str | None
    lease: LeaseStatus | None
    engines: list[EngineHealth]
    inference: InferenceHealth


# --- management (/api) ---


class CatalogueEntry(Shape):
    id: str
    kind: Literal["catalogue", "checkpoint"]
    source: str
    format: Literal["folder", "gguf", "safetensors"]
    revision: str | None
    dtype: str | None
    quantization: str | None
    context_length: int | None
    hidden_size: int | None
    num_layers: int | None
    base: str | None
    state: Literal["available", "loading", "resident", "unloading", "error"]
    state_detail: str | None
    weights: Literal["clean", "torn"]
    created_at: int


class ControlAccepted(Shape):
    """A load or unload the engine took on (202); progress shows in the entry's state."""

    model: CatalogueEntry
    engine: str


class LeaseAcquired(LeaseStatus):
    id: Annotated[str, Field(description="The lease id: shown in this response only")]


class LeaseReleased(LeaseStatus):
    released: Literal[True]


class WeightsState(Shape):
    model: str
    weights: Literal["clean", "torn"]
    written: list[str] | None = None


class SavedCheckpoint(Shape):
    model: str
    base: str | None
    renamed_from: str
    revision: str | None
    path: str


class ProbeSummary(Shape):
    id: str
    name: str
    model: str
    layer: int
    d_model: int
    aggregation: Literal["mean", "max", "last"]
    threshold: float | None
    created_at: int


class ProbeDetail(ProbeSummary):
    weights: list[float]
    bias: float
    norm_mean: Union[float, list[float]]
    norm_std: Union[float, list[float]]


class ProbeDeleted(Shape):
    id: str
    deleted: Literal[True]


class ProbeVerdict(Shape):
    probe_id: str
    name: str
    window: Literal["all", "prompt", "response"]
    threshold: float | None
    score: float | None
    verdict: bool | None
    not_scored_reason: str | None = None


class ProbeResult(Shape):
    index: int
    n_tokens: int
    prompt_tokens: int
    token_ids: list[int] | None = None
    verdicts: list[ProbeVerdict]


class ScoredModel(Shape):
    id: str


class ProbeScores(Shape):
    model: ScoredModel
    results: list[ProbeResult]


# --- files and batches (DRF) ---


class FileObject(Shape):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed", "error"]
    status_details: str | None


@extend_schema_serializer(many=False)
class FileList(Shape):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(Shape):
    id: str
    object: Literal["file"]
    deleted: Literal[True]


def _no_default(schema):
    schema.pop("default", None)


class FileUpload(BaseModel):
    """POST /v1/files, multipart."""

    # The expiry is both parts or neither.
    model_config = ConfigDict(populate_by_name=True, json_schema_extra={"dependentRequired": {
        "expires_after[anchor]": ["expires_after[seconds]"], "expires_after[seconds]": ["expires_after[anchor]"],
    }})
    file: Annotated[bytes, Field(description="The JSONL file")]
    purpose: Literal["batch"]
    # Multipart parts are never null: an unsent part is left out.
    expires_after_anchor: Literal["created_at"] | SkipJsonSchema[None] = Field(
        None, alias="expires_after[anchor]", json_schema_extra=_no_default
    )
    expires_after_seconds: Annotated[int, Field(ge=EXPIRES_AFTER_MIN_S, le=EXPIRES_AFTER_MAX_S)] | SkipJsonSchema[None] = Field(
        None, alias="expires_after[seconds]", json_schema_extra=_no_default
    )


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=EXPIRES_AFTER_MIN_S, le=EXPIRES_AFTER_MAX_S)]


class BatchCreate(BaseModel):
    """POST /v1/batches; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: Annotated[str, Field(min_length=1)]
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/probes/score"]
    completion_window: Annotated[str, Field(pattern=r"^[1-9][0-9]{0,3}h$", description='"24h", or whole hours "1h"-"168h"')]
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    output_expires_after: OutputExpiresAfter | None = None
    pack: bool | None = None
    pack_window: Annotated[int, Field(ge=0)] | None = None
    batched_decoding: bool | None = None


class BatchErrorItem(Shape):
    code: str
    line: int | None
    message: str
    param: str | None = None


class BatchErrors(Shape):
    object: Literal["list"]
    data: list[BatchErrorItem]


class RequestCounts(Shape):
    total: int
    completed: int
    failed: int


class CachedTokens(Shape):
    cached_tokens: int


class ReasoningTokens(Shape):
    reasoning_tokens: int


class BatchUsage(Shape):
    input_tokens: int
    input_tokens_details: CachedTokens
    output_tokens: int
    output_tokens_details: ReasoningTokens
    total_tokens: int


class BatchMillm(Shape):
    pack: bool
    pack_window: int
    batched_decoding: bool
    waiting_reason: Literal["queued", "model_not_resident", "lease_unavailable", "weights_torn"] | None
    lease_mode: Literal["own", "caller"] | None
    output_expires_after: int | None


class BatchObject(Shape):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    usage: BatchUsage
    millm: BatchMillm


@extend_schema_serializer(many=False)
class BatchList(Shape):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


# --- request headers ---

LEASE_HEADER = OpenApiParameter(
    "X-miLLM-Lease", str, OpenApiParameter.HEADER, description="A lease id: act despite your own lease"
)
IDEMPOTENCY_HEADER = OpenApiParameter(
    "Idempotency-Key", str, OpenApiParameter.HEADER, description="The same key answers the first object again for 24 hours"
)


def _header(name, schema, description):
    return {"name": name, "in": "header", "required": False, "schema": schema, "description": description}


STRICT = _header(
    "X-miLLM-Strict", {"type": "string", "enum": ["true", "false", "1", "0"]},
    "Strict mode refuses unused fields (unused_fields_refused); case-insensitive",
)
LOAD_POLICY = _header(
    "X-miLLM-Load-Policy", {"type": "string", "enum": ["auto", "refuse"]},
    "refuse: 409 model_not_resident instead of loading the model",
)
LEASE = _header("X-miLLM-Lease", {"type": "string"}, "A lease id: act despite your own lease")


# --- DRF viewsets: files and batches ---


def _drf_errors():
    return {"4XX": OpenApiResponse(OpenAIError, "Refused, in OpenAI's envelope"),
            "5XX": OpenApiResponse(OpenAIError, "Unavailable or failed, in OpenAI's envelope")}


_ID = OpenApiParameter("id", str, OpenApiParameter.PATH)

file_viewset_schema = extend_schema_view(
    list=extend_schema(
        summary="List files, newest first",
        parameters=[
            OpenApiParameter("purpose", str, OpenApiParameter.QUERY, enum=["batch", "batch_output"]),
            OpenApiParameter("limit", int, OpenApiParameter.QUERY, description="1-10,000 (default 10,000)"),
            OpenApiParameter("after", str, OpenApiParameter.QUERY, description="The last id of the previous page"),
            OpenApiParameter("order", str, OpenApiParameter.QUERY, enum=["asc", "desc"]),
        ],
        responses={200: FileList, **_drf_errors()},
    ),
    retrieve=extend_schema(summary="A file", parameters=[_ID], responses={200: FileObject, **_drf_errors()}),
    create=extend_schema(
        summary="Upload a batch input file (JSONL)",
        parameters=[IDEMPOTENCY_HEADER],
        request={"multipart/form-data": FileUpload},
        responses={200: FileObject, **_drf_errors()},
    ),
    destroy=extend_schema(summary="Delete a file", parameters=[_ID], responses={200: FileDeleted, **_drf_errors()}),
    content=extend_schema(
        summary="A file's bytes (application/jsonl whatever Accept says)",
        parameters=[_ID],
        responses={(200, "application/jsonl"): OpenApiResponse({"type": "string", "format": "binary"}),
                   **_drf_errors()},
    ),
)

batch_viewset_schema = extend_schema_view(
    list=extend_schema(
        summary="List batches, newest first",
        parameters=[
            OpenApiParameter("limit", int, OpenApiParameter.QUERY, description="1-100 (default 20)"),
            OpenApiParameter("after", str, OpenApiParameter.QUERY, description="The last id of the previous page"),
        ],
        responses={200: BatchList, **_drf_errors()},
    ),
    retrieve=extend_schema(summary="A batch", parameters=[_ID], responses={200: BatchObject, **_drf_errors()}),
    create=extend_schema(
        summary="Start a batch from an uploaded file",
        parameters=[LEASE_HEADER, IDEMPOTENCY_HEADER],
        request=BatchCreate,
        responses={200: BatchObject, **_drf_errors()},
    ),
    cancel=extend_schema(summary="Cancel a batch", parameters=[_ID], request=None,
                         responses={200: BatchObject, **_drf_errors()}),
    lease=extend_schema(summary="Hand your live lease (X-miLLM-Lease) to an unfinished batch",
                        parameters=[_ID, LEASE_HEADER], request=None,
                        responses={200: BatchObject, **_drf_errors()}),
)


# --- plain views ---

JSON = "application/json"


@dataclass(frozen=True)
class Op:
    summary: str
    responses: dict  # status -> a Shape class, a JSON schema dict, or (media type -> either)
    request: Any = None  # a pydantic model, or a dict of media type -> JSON schema
    request_required: bool = True
    headers: tuple = ()
    envelope: str = "v1"  # "v1", "management" or "none": which error envelope its errors use
    tags: tuple = field(default_factory=tuple)


def data(shape):
    """The management success envelope around `shape`."""
    return {"__envelope__": shape}


def sse(chunk):
    """Server-sent events: each `data:` a JSON chunk (or an error), then `data: [DONE]`."""
    return {"__sse__": chunk}


GENERATION_HEADERS = (STRICT, LOAD_POLICY, LEASE)

PLAIN_VIEWS = {
    "inference_app.views.chat_completions": {
        "POST": Op("Chat completion (stream: true answers server-sent events)", {
            200: {JSON: ChatCompletion, "text/event-stream": sse(ChatCompletionChunk)},
        }, request=request_schemas.ChatCompletionRequest, headers=GENERATION_HEADERS),
    },
    "inference_app.views.completions": {
        "POST": Op("Completion (stream: true answers server-sent events)", {
            200: {JSON: Completion, "text/event-stream": sse(CompletionChunk)},
        }, request=request_schemas.CompletionRequest, headers=GENERATION_HEADERS),
    },
    "inference_app.views.embeddings": {
        "POST": Op("Embeddings", {200: EmbeddingList}, request=request_schemas.EmbeddingRequest, headers=GENERATION_HEADERS),
    },
    "inference_app.views.models_list": {"GET": Op("The models a request can name", {200: ModelList})},
    "inference_app.views.model_detail": {"GET": Op("One model", {200: ModelObject})},
    "inference_app.views.health": {"GET": Op("Liveness", {200: Health}, envelope="none")},
    "inference_app.views.health_detailed": {"GET": Op("Engines, lease and queue", {200: HealthDetailed}, envelope="none")},
    "inference_app.views.metrics_view": {
        "GET": Op("Prometheus metrics", {200: {"text/plain": {"type": "string"}}}, envelope="none"),
    },
    "inference_app.api_views.models": {
        "GET": Op("The catalogue", {200: data({"type": "array", "items": CatalogueEntry})}, envelope="management"),
        "POST": Op("Register a model on the server's disk", {201: data(CatalogueEntry)},
                   request=request_schemas.ModelRegistration, envelope="management"),
    },
    "inference_app.api_views.model": {
        "GET": Op("A catalogue entry", {200: data(CatalogueEntry)}, envelope="management"),
    },
    "inference_app.api_views.model_load": {
        "POST": Op("Make the model resident (in the background)", {202: data(ControlAccepted)},
                   request=request_schemas.LoadRequest, request_required=False, headers=(LEASE,), envelope="management"),
    },
    "inference_app.api_views.model_unload": {
        "POST": Op("Unload the resident model (in the background)", {202: data(ControlAccepted)},
                   headers=(LEASE,), envelope="management"),
    },
    "inference_app.api_views.weights_begin": {
        "POST": Op("Begin a weights edit (weights torn)", {200: data(WeightsState)}, headers=(LEASE,),
                   envelope="management"),
    },
    "inference_app.api_views.weights_write": {
        "PUT": Op("Overwrite named tensors (a safetensors body)", {200: data(WeightsState)},
                  request={"application/octet-stream": {"type": "string", "format": "binary"}},
                  headers=(LEASE,), envelope="management"),
    },
    "inference_app.api_views.weights_commit": {
        "POST": Op("Commit a weights edit (weights clean)", {200: data(WeightsState)}, headers=(LEASE,),
                   envelope="management"),
    },
    "inference_app.api_views.model_save": {
        "POST": Op("Save the resident weights as a checkpoint", {201: data(SavedCheckpoint)}, headers=(LEASE,),
                   envelope="management"),
    },
    "inference_app.api_views.lease": {
        "GET": Op("The lease's status (never its id), or null", {200: data({"anyOf": [LeaseStatus, {"type": "null"}]})},
                  envelope="management"),
        "POST": Op("Acquire the lease (its id is shown once)", {201: data(LeaseAcquired)},
                   request=request_schemas.LeaseRequest, envelope="management"),
        "DELETE": Op("Release the lease named by X-miLLM-Lease", {200: data(LeaseReleased)}, headers=(LEASE,),
                     envelope="management"),
    },
    "inference_app.api_views.lease_renew": {
        "POST": Op("Renew the lease named by X-miLLM-Lease", {200: data(LeaseStatus)}, headers=(LEASE,),
                   envelope="management"),
    },
    "inference_app.api_views.probes": {
        "GET": Op("The probes", {200: data({"type": "array", "items": ProbeSummary})}, envelope="management"),
        "POST": Op("Import a probe, checked against the resident model", {201: data(ProbeSummary)},
                   request=request_schemas.ProbeImport, envelope="management"),
    },
    "inference_app.api_views.probe": {
        "GET": Op("A probe", {200: data(ProbeDetail)}, envelope="management"),
        "DELETE": Op("Delete a probe", {200: data(ProbeDeleted)}, envelope="management"),
    },
    "inference_app.api_views.probe_score": {
        "POST": Op("Score inputs with probes on the resident model", {200: data(ProbeScores)},
                   request=request_schemas.ProbeScoreRequest, envelope="management"),
    },
}

# Not part of the API: the admin (staff login, HTML).
EXCLUDED_NAMESPACES = ("admin",)


def dotted(view):
    return f"{view.__module__}.{view.__qualname__}"


def is_drf(view):
    return hasattr(view, "cls")


def route_methods(view):
    """The methods a plain view allows, read from its require_http_methods decorator."""
    func = view
    while func is not None:
        closure = inspect.getclosurevars(func).nonlocals if func.__closure__ else {}
        if "request_method_list" in closure:
            return sorted(method.upper() for method in closure["request_method_list"])
        func = getattr(func, "__wrapped__", None)
    raise ImproperlyConfigured(f"{dotted(view)} allows every method: decorate it with require_http_methods")


def iter_routes(patterns=None, prefix="", namespace=None):
    """(OpenAPI path, view, namespace) of every route in the URL resolver."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        if isinstance(entry, URLResolver):
            yield from iter_routes(entry.url_patterns, prefix + _template(entry.pattern), entry.namespace or namespace)
        elif isinstance(entry, URLPattern):
            yield "/" + prefix + _template(entry.pattern), entry.callback, namespace


def _template(pattern):
    """A Django route as an OpenAPI path template: `<path:model_id>` -> `{model_id}`. Regex
    patterns (DRF's router) come back as written; drf-spectacular names them itself."""
    if isinstance(pattern, RoutePattern):
        return re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", str(pattern))
    return str(pattern)


def plain_routes():
    """(path, view) of every route that is neither DRF's nor excluded."""
    for path, view, namespace in iter_routes():
        if namespace in EXCLUDED_NAMESPACES or is_drf(view):
            continue
        yield path, view


class Components:
    """Component schemas from pydantic models: `$defs` hoisted, each name defined once."""

    def __init__(self, schemas):
        self.schemas = schemas

    def add(self, name, schema):
        known = self.schemas.get(name)
        if known is not None and known != schema:
            raise ImproperlyConfigured(f"two different OpenAPI components are named {name}")
        self.schemas[name] = schema

    def ref(self, model, mode="serialization"):
        schema = model.model_json_schema(ref_template=REF, mode=mode)
        if mode == "validation":
            _only_neutral(schema)  # a request body
        for name, sub in schema.pop("$defs", {}).items():
            self.add(name, sub)
        self.add(model.__name__, schema)
        return {"$ref": REF.format(model=model.__name__)}

    def resolve(self, value):
        """A response or request schema: Shape classes become refs, helpers are expanded."""
        if isinstance(value, type) and issubclass(value, BaseModel):
            return self.ref(value)
        if isinstance(value, dict) and "__envelope__" in value:
            return {
                "type": "object",
                "required": ["success", "data", "error"],
                "properties": {"success": {"const": True}, "data": self.resolve(value["__envelope__"]),
                               "error": {"type": "null"}},
            }
        if isinstance(value, dict) and "__sse__" in value:
            payload = {"anyOf": [self.resolve(value["__sse__"]), self.ref(OpenAIError)]}
            return {
                "type": "object",
                "description": "One server-sent event; the last one's data is [DONE]",
                "required": ["data"],
                "properties": {"data": {"anyOf": [
                    {"const": "[DONE]"},
                    {"type": "string", "contentMediaType": JSON, "contentSchema": payload},
                ]}},
            }
        if isinstance(value, dict):
            return {key: self.resolve(item) if isinstance(item, (dict, list, type)) else item for key, item in value.items()}
        if isinstance(value, list):
            return [self.resolve(item) for item in value]
        return value


def _operation(path, method, view, op, components):
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
        for name in _path_names(path)
    ] + [dict(header) for header in op.headers]
    responses = {}
    for status, body in op.responses.items():
        content = body if isinstance(body, dict) and all("/" in key for key in body) else {JSON: body}
        responses[str(status)] = {
            "description": op.summary,
            "content": {media: {"schema": components.resolve(schema)} for media, schema in content.items()},
        }
    if op.envelope != "none":
        error = components.ref(OpenAIError if op.envelope == "v1" else ManagementError)
        responses["4XX"] = {"description": "Refused", "content": {JSON: {"schema": error}}}
        responses["5XX"] = {"description": "Unavailable or failed (503 carries Retry-After)",
                            "content": {JSON: {"schema": error}}}
    operation = {
        "operationId": f"{dotted(view).rsplit('.', 1)[-1]}_{method.lower()}",
        "summary": op.summary,
        "tags": list(op.tags) or [_tag(path)],
        "parameters": parameters,
        "responses": responses,
    }
    if op.request is not None:
        if isinstance(op.request, type):
            content = {JSON: {"schema": components.ref(op.request, mode="validation")}}
        else:
            content = {media: {"schema": schema} for media, schema in op.request.items()}
        operation["requestBody"] = {"required": op.request_required, "content": content}
    if op.envelope == "none" and path.startswith("/api/health"):
        operation["security"] = [{}]  # health never needs a key (SPEC 1)
    return operation


def _only_neutral(schema):
    """Fields the server cannot honour take only their neutral value (schemas.NEUTRAL); any
    other is 400 field_not_honoured, and `dimensions` is refused whatever its value."""
    properties = schema.get("properties", {})
    for name, neutral in request_schemas.NEUTRAL.items():
        if name in properties:
            properties[name] = {
                "anyOf": [{"const": neutral}, {"type": "null"}],
                "description": f"Only {json.dumps(neutral)}: this server cannot honour another value (field_not_honoured)",
            }
    if "dimensions" in properties:
        properties["dimensions"] = {"type": "null", "description": "Refused (field_not_honoured): embeddings have the model's own width"}


def _path_names(path):
    return re.findall(r"{([^}]+)}", path)


def _tag(path):
    parts = path.strip("/").split("/")
    return parts[1] if parts[0] in ("v1", "api") and len(parts) > 1 else parts[0]


def add_plain_views(result, generator, request, public):
    """drf-spectacular postprocessing hook: every plain Django route, from the URL resolver."""
    components = Components(result.setdefault("components", {}).setdefault("schemas", {}))
    paths = result.setdefault("paths", {})
    for path, view in plain_routes():
        documented = PLAIN_VIEWS.get(dotted(view))
        if documented is None:
            raise ImproperlyConfigured(f"{path} ({dotted(view)}) has no entry in millm_lib.openapi.PLAIN_VIEWS")
        item = paths.setdefault(path, {})
        for method in route_methods(view):
            if method not in documented:
                raise ImproperlyConfigured(f"{method} {path} has no entry in millm_lib.openapi.PLAIN_VIEWS")
            item[method.lower()] = _operation(path, method, view, documented[method], components)
    components.ref(OpenAIError)
    components.ref(ManagementError)
    result["components"]["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer", "description": "A key from MILLM_API_KEYS, when it is set"},
    }
    # A key is needed only when MILLM_API_KEYS is set: `{}` says no key is also accepted then.
    result["security"] = [{"bearer": []}, {}]
    for path, item in paths.items():
        if not path.startswith("/api/health"):
            for operation in item.values():
                # drf-spectacular marks its own view public (AllowAny); the key middleware decides.
                operation.pop("security", None)
    result["paths"] = dict(sorted(paths.items()))
    return result


class SchemaView(SpectacularJSONAPIView):
    """GET /api/schema/: this schema, as application/json whatever Accept says."""

    renderer_classes = [OpenApiJsonRenderer2]

    @extend_schema(
        summary="This OpenAPI 3.1 schema",
        responses={200: OpenApiResponse({"type": "object", "required": ["openapi", "info", "paths"]}),
                   "4XX": ManagementError, "5XX": ManagementError},
    )
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    def perform_content_negotiation(self, request, force=False):
        return super().perform_content_negotiation(request, force=True)
