"""Thin views of the Responses API (SPEC 4a): parse, read the chain, forward the chat request
the response is (gateway), answer it as a response object or events, keep it."""

import json
import time

from asgiref.sync import sync_to_async
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods, require_POST
from prometheus_client import Counter

from inference_app import gateway
from inference_app.catalogue import parse_load_policy
from inference_app.leases import LEASE_HEADER
from inference_app.provenance import ignored_fields_header
from inference_app.schemas import parse_request, parse_strict_header
from inference_app.headers import GENERATION_HEADERS
from millm_lib import metrics
from millm_lib.errors import ApiError, json_response, require_json
from millm_lib.ids import new_id
from millm_lib.jsonbody import decode_json
from millm_lib.limits import CHAT, RESPONSES
from millm_lib.openapi import JSON, Op, documented
from millm_lib.pagination import list_page, query_choice, query_int
from millm_lib.streaming import event_stream
from projects_app.models import quota_exceeded, stored_bytes
from responses_app.answers import EventStream, from_chat
from responses_app.models import StoredResponse
from responses_app.requests import ResponseRequest, as_json, renamed
from responses_app.shapes import InputItemList, Response, ResponseDeleted, StreamEvent

answered = Counter("millm_responses_total", "Responses answered by POST /v1/responses, by status",
                   ["status"], registry=metrics.registry)


def _sse_events(schema):
    return {"type": "object", "description": "One server-sent event: `event: <type>`, then its data",
            "properties": {"event": {"type": "string"}, "data": {"type": "string", "contentMediaType": JSON,
                                                               "contentSchema": schema}}}


@documented(POST=Op("Create a response (stream: true answers the Responses API's server-sent events)", {
    200: {JSON: Response, "text/event-stream": _sse_events(StreamEvent)},
}, request=ResponseRequest, headers=GENERATION_HEADERS))
@csrf_exempt
@require_POST
async def create(request):
    require_json(request)
    strict = parse_strict_header(request.headers.get("X-miLLM-Strict"))
    policy = parse_load_policy(request.headers.get("X-miLLM-Load-Policy"))
    parsed = parse_request(RESPONSES, decode_json(request.body), strict)
    asked = parsed.request
    project = getattr(request, "project", None)
    context = await sync_to_async(_context)(asked, project, len(request.body))
    engine = await gateway.engine_for(asked.model, policy)
    chat = asked.chat_body(context)
    if asked.stream:
        chat.update(stream=True, stream_options={"include_usage": True})
    extra = {"load_policy": policy, "lease": request.headers.get(LEASE_HEADER), "project": gateway.caller(request)}
    response_id = new_id("resp_")
    kept = [*context, *asked.input_items()]
    try:
        if asked.stream:
            headers, chunks = await gateway.open_stream(engine, CHAT, as_json(chat), True, request.request_id, extra)
        else:
            body, headers = await gateway.call(engine, CHAT, as_json(chat), True, request.request_id, extra)
    except ApiError as error:
        answered.labels("failed").inc()
        raise renamed(error) from None
    headers = _headers(headers, parsed.ignored)
    if asked.stream:
        events = EventStream(asked, response_id, headers.get("X-miLLM-Model", asked.model))
        return event_stream(_stream(events, chunks, kept, project), headers)
    answer = from_chat(asked, response_id, body, int(time.time()))
    await sync_to_async(_keep)(asked, answer, kept, project)
    return json_response(answer, headers=headers)


def _context(asked, project, size):
    """The stored conversation `previous_response_id` continues (404 as unknown when it is not
    the caller's), after refusing a stored response over the project's stored-bytes quota."""
    if asked.store and project is not None and project.limit("file_bytes") is not None:
        refusal = quota_exceeded(project, "file_bytes", stored_bytes([project.pk])[project.pk], size)
        if refusal is not None:
            raise refusal
    if asked.previous_response_id is None:
        return []
    try:
        return StoredResponse.objects.found(asked.previous_response_id, project).conversation()
    except ApiError as error:
        raise ApiError(404, error.code, error.message, param="previous_response_id") from None


def _headers(headers, ignored):
    """The chat answer's provenance headers, with this body's own ignored fields."""
    headers = dict(headers)
    headers.pop("X-miLLM-Ignored-Fields", None)
    if ignored:
        headers["X-miLLM-Ignored-Fields"] = ignored_fields_header(ignored)
    return headers


def _keep(asked, answer, kept, project):
    answered.labels(answer["status"]).inc()
    if asked.store:
        StoredResponse.keep(answer, kept, project)


async def _stream(events, chunks, kept, project):
    """The events of a streamed response; the last one, once the answer is kept, completes it.
    A client that leaves closes `chunks`, which frees its seat (gateway)."""
    for event in events.start():
        yield _sse(event)
    try:
        async for chunk in chunks:
            for event in events.feed(chunk):
                yield _sse(event)
    except ApiError as error:
        closing = events.fail(renamed(error))
    else:
        closing = events.finish()
    finally:
        await chunks.aclose()
    await sync_to_async(_keep)(events.request, events.response, kept, project)
    for event in closing:
        yield _sse(event)


def _sse(event):
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


@documented(
    GET=Op("A stored response", {200: Response}),
    DELETE=Op("Delete a stored response", {200: ResponseDeleted}),
)
@csrf_exempt
@require_http_methods(["GET", "DELETE"])
def stored(request, response_id):
    found = StoredResponse.objects.found(response_id, request.project)
    if request.method == "DELETE":
        found.delete()
        return json_response(ResponseDeleted(id=response_id, object="response", deleted=True))
    return json_response(found.body)


@documented(GET=Op("The items a stored response read (paginated: after, limit, order)", {200: InputItemList}))
@csrf_exempt
@require_http_methods(["GET"])
def input_items(request, response_id):
    found = StoredResponse.objects.found(response_id, request.project)
    after = request.GET.get("after") or None
    limit = query_int(request, "limit", 20, 1, 100)
    order = query_choice(request, "order", "desc", ("asc", "desc"))
    items = list(found.input_items if order == "asc" else reversed(found.input_items))
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, "invalid_parameter", f"Invalid value for 'after': {after!r} is not an item of "
                           f"{response_id}", param="after")
        items = items[ids.index(after) + 1:]
    return json_response(list_page(InputItemList, items[:limit], len(items) > limit))
