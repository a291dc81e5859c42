"""Thin views: parse, call the gateway or one model query, render."""

import json
import time

from django.conf import settings
from django.http import HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from prometheus_client import CONTENT_TYPE_LATEST

from inference_app import backlog, gateway
from millm_lib import metrics
from inference_app.catalogue import parse_load_policy, requestable, resolve
from inference_app.leases import LEASE_HEADER
from millm_lib.errors import ApiError, json_response, require_json
from inference_app.models import Engine, Lease
from millm_lib.jsonbody import decode_json
from millm_lib.streaming import event_stream
from millm_lib.limits import CHAT, COMPLETIONS, EMBEDDINGS
from millm_lib.openapi import JSON, Op, documented, sse
from inference_app.headers import GENERATION_HEADERS
from inference_app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    parse_request,
    parse_strict_header,
)
from inference_app.shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    EmbeddingList,
    Health,
    HealthDetailed,
    InferenceHealth,
    ModelList,
    ModelObject,
)



async def _infer(request, endpoint):
    require_json(request)
    raw = request.body
    strict = parse_strict_header(request.headers.get("X-miLLM-Strict"))
    policy = parse_load_policy(request.headers.get("X-miLLM-Load-Policy"))
    parsed = parse_request(endpoint, decode_json(raw), strict)
    engine = await gateway.engine_for(parsed.request.model, policy)
    text = raw.decode("utf-8")
    extra = {"load_policy": policy, "lease": request.headers.get(LEASE_HEADER), "project": gateway.caller(request)}
    if getattr(parsed.request, "stream", False):
        headers, messages = await gateway.open_stream(engine, endpoint, text, strict, request.request_id, extra)
        return event_stream(_sse(messages), headers)
    body, headers = await gateway.call(engine, endpoint, text, strict, request.request_id, extra)
    return json_response(body, headers=headers)


async def _sse(messages):
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    try:
        async for chunk in messages:
            yield f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"
    except ApiError as error:
        yield f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


@documented(POST=Op("Chat completion (stream: true answers server-sent events)", {
    200: {JSON: ChatCompletion, "text/event-stream": sse(ChatCompletionChunk)},
}, request=ChatCompletionRequest, headers=GENERATION_HEADERS))
@csrf_exempt
@require_POST
async def chat_completions(request):
    return await _infer(request, CHAT)


@documented(POST=Op("Completion (stream: true answers server-sent events)", {
    200: {JSON: Completion, "text/event-stream": sse(CompletionChunk)},
}, request=CompletionRequest, headers=GENERATION_HEADERS))
@csrf_exempt
@require_POST
async def completions(request):
    return await _infer(request, COMPLETIONS)


@documented(POST=Op("Embeddings", {200: EmbeddingList}, request=EmbeddingRequest, headers=GENERATION_HEADERS))
@csrf_exempt
@require_POST
async def embeddings(request):
    return await _infer(request, EMBEDDINGS)


@documented(GET=Op("The models a request can name", {200: ModelList}))
@csrf_exempt  # no cookie session here: a wrong method is 405, never a CSRF 403
@require_GET
def models_list(request):
    data = [entry.to_openai() for entry in requestable()]
    return json_response(ModelList(object="list", data=data))


@documented(GET=Op("One model", {200: ModelObject}))
@csrf_exempt
@require_GET
def model_detail(request, model_id):
    return json_response(resolve(model_id).to_openai())


@documented(GET=Op("Liveness", {200: Health}, envelope="none"))
@csrf_exempt
@require_GET
def health(request):
    return json_response(Health(status="ok", version=settings.VERSION, timestamp=int(time.time())))


@documented(GET=Op("Engines, lease and queue", {200: HealthDetailed}, envelope="none"))
@csrf_exempt
@require_GET
def health_detailed(request):
    engines = list(Engine.objects.all())
    live = [engine for engine in engines if engine.alive]
    active = [engine for engine in live if engine.role == Engine.Role.ACTIVE and engine.resident_model_id]
    serving = active[0] if active else None
    return json_response(
        HealthDetailed(
            status="ok" if serving else "degraded",
            version=settings.VERSION,
            timestamp=int(time.time()),
            model_loaded=serving is not None,
            model_name=serving.resident_model_id if serving else None,
            lease=_lease_status(serving),
            engines=[engine.to_health() for engine in engines],
            inference=InferenceHealth(
                # Seats an engine decodes together (ENGINE_MAX_SEQUENCES, as the engine reported it).
                backend="batched" if serving and serving.queue_max_concurrent > 1 else "serial",
                queue_pending=sum(engine.queue_waiting + engine.in_flight for engine in active),
                queue_max_concurrent=serving.queue_max_concurrent if serving else settings.ENGINE_MAX_SEQUENCES,
                queue_max_pending=settings.MAX_PENDING_REQUESTS,
                in_flight=sum(engine.in_flight for engine in active),
                queue_waiting=sum(engine.queue_waiting for engine in active),
                estimated_wait_seconds=serving.estimated_wait_seconds if serving else None,
                # Each unrun row of each active batch once, from the database (not the engines'
                # heartbeats: two replicas of one model would count its rows twice).
                batch_backlog_rows=backlog.total_rows(),
            ),
        )
    )


def _lease_status(engine):
    lease = Lease.objects.on_model(engine.resident_model_id) if engine else None
    return lease.status() if lease else None  # the status, never the id


@documented(GET=Op("Prometheus metrics", {200: {"text/plain": {"type": "string"}}}, envelope="none"))
@csrf_exempt
@require_GET
def metrics_view(request):
    return HttpResponse(metrics.render(), content_type=CONTENT_TYPE_LATEST)
