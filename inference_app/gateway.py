"""Web's side of the engine: find the live engine of a model and forward a request to it.

A request travels as one message to the engine's channel; the answer (or the stream of chunks)
comes back on a reply channel of this process. While waiting, web re-checks the engine's
heartbeat, so a request to an engine that died answers 503 within ENGINE_STALE_S instead of
hanging until MILLM_REQUEST_TIMEOUT_S.
"""

import asyncio
import collections
import time

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings

from inference_app.catalogue import check_request_may_load, model_not_loaded, resolve
from inference_app.engine import policy
from millm_lib.db import on_db_pool
from millm_lib.errors import ApiError
from inference_app.models import Engine


def caller(request):
    """The caller's project id, which a message to the engine carries for its ownership checks
    (the leases and probes a caller may present, SPEC 10d)."""
    project = getattr(request, "project", None)
    return project.pk if project is not None else None


def engine_unavailable(model_id):
    return ApiError(
        503,
        "engine_unavailable",
        f"No live engine serves the model '{model_id}'. Start one: "
        f"MILLM_MODEL=<its folder or .gguf> python manage.py runbatchworker",
        retry_after=5,
    )


@on_db_pool
def engine_for(model_name, load_policy="auto"):
    """Resolve the request's model by the catalogue rules, then pick the engine to send it to:
    the one serving or loading it; else (load policy auto) one that will load it."""
    engines = list(Engine.objects.live().active())  # newest heartbeat first
    entry = resolve(model_name, engines)
    engine = _serving_or_loading(entry.id, engines)
    if engine is not None:
        return engine
    resident = ", ".join(e.resident_model_id for e in engines if e.resident_model_id) or None
    check_request_may_load(entry, load_policy, resident)
    return autoload_candidate(entry.id, engines)


def engine_to_load(model_id, engine_id=None):
    """Where POST /api/models/{id}/load sends its load: the live active engine `engine_id`
    names; else the one serving or loading the model; else one that will load it."""
    engines = list(Engine.objects.live().active())  # newest heartbeat first
    if engine_id is not None:
        engine = next((e for e in engines if e.pk == engine_id), None)
        if engine is None:
            raise ApiError(404, "engine_not_found", f"No live active engine has the id '{engine_id}'",
                           details={"field": "engine"})
        return engine
    return _serving_or_loading(model_id, engines) or autoload_candidate(model_id, engines)


def _serving_or_loading(model_id, engines):
    """The engine for a request to `model_id`: of its live replicas with it resident, the one with
    the least work; else one loading it."""
    serving = [e for e in engines if e.resident_model_id == model_id]
    if serving:
        return least_busy(serving)
    return next((e for e in engines if e.loading_model_id == model_id), None)


# Requests this web process has in flight to each engine (by id): always fresh, where an engine's
# own figures are as old as its last heartbeat (up to ENGINE_HEARTBEAT_S). A burst of requests
# spreads over the replicas at once instead of all going to whichever looked idle last.
_in_flight = collections.Counter()


def least_busy(engines):
    """Of a model's replicas, the one the policy picks, counting this process's requests in flight."""
    return policy.least_busy(engines, _in_flight)


def autoload_candidate(model_id, engines):
    """The engine that should load `model_id`: one started for it, an idle one, or the only one;
    503 engine_unavailable when there is none."""
    for engine in engines:
        if engine.model_id == model_id:
            return engine
    for engine in engines:
        if not engine.resident_model_id and not engine.loading_model_id:
            return engine
    if len(engines) > 1:
        raise model_not_loaded(
            f"The model '{model_id}' is not loaded and {len(engines)} engines serve other models; "
            f"choose one with POST /api/models/{model_id}/load {{\"engine\": ...}}"
        )
    if not engines:
        raise engine_unavailable(model_id)
    return engines[0]


@on_db_pool
def engine_with_resident_model(model_id=None):
    """For probe scoring (which names no model): the least busy replica serving `model_id`, or of
    the only model resident."""
    engines = [e for e in Engine.objects.live().active() if e.resident_model_id]
    if model_id is not None:
        engines = [e for e in engines if e.resident_model_id == model_id]
        if not engines:
            raise engine_unavailable(model_id)
        return least_busy(engines)
    if not engines:
        raise model_not_loaded()
    if len({e.resident_model_id for e in engines}) > 1:
        raise ApiError(
            400,
            "invalid_probe_score_request",
            "Several engines have a resident model; name probe_ids to choose which model scores",
            details={"field": "probe_ids"},
        )
    return least_busy(engines)


@on_db_pool
def _engine_alive(engine_id):
    return Engine.objects.live().filter(pk=engine_id, role=Engine.Role.ACTIVE).exists()


class Forwarded:
    """One request in flight to an engine, and the reply channel its answer comes back on."""

    def __init__(self, engine, endpoint, raw_body, strict, request_id, stream, extra=None):
        self.engine = engine
        self.layer = get_channel_layer()
        self.request_id = request_id
        self.deadline = time.time() + settings.MILLM_REQUEST_TIMEOUT_S
        self.message = {
            "type": "infer",
            "id": request_id,
            "endpoint": endpoint,
            "body": raw_body,
            "strict": strict,
            "stream": stream,
            "deadline": self.deadline,
            **(extra or {}),
        }
        self.reply = None
        self.finished = False
        self._counted = False

    async def send(self):
        self.reply = await self.layer.new_channel()
        self.message["reply"] = self.reply
        _in_flight[self.engine.pk] += 1
        self._counted = True
        await self.layer.send(self.engine.channel, self.message)

    def uncount(self):
        """The request is over for routing's count, however it ended (once)."""
        if self._counted:
            self._counted = False
            _in_flight[self.engine.pk] -= 1
            if _in_flight[self.engine.pk] <= 0:
                del _in_flight[self.engine.pk]

    async def next_message(self):
        """The next message on the reply channel, or the 503/504 that replaces it.

        Every ENGINE_STALE_S without a message the engine's heartbeat is checked. The receive
        itself is never cancelled for that check: channels_redis drops a message that arrives
        as its receive is cancelled, and the request would then wait for an answer already sent.
        """
        receiving = asyncio.ensure_future(self.layer.receive(self.reply))
        try:
            while True:
                remaining = self.deadline - time.time()
                if remaining <= 0:
                    await self.cancel()
                    raise ApiError(
                        504,
                        "request_timeout",
                        f"The engine did not answer within {settings.MILLM_REQUEST_TIMEOUT_S:g} s (MILLM_REQUEST_TIMEOUT_S)",
                    )
                done, _ = await asyncio.wait({receiving}, timeout=min(remaining, settings.ENGINE_STALE_S))
                if done:
                    return receiving.result()
                if not await _engine_alive(self.engine.id):
                    self.finished = True
                    raise engine_unavailable(self.engine.resident_model_id or self.engine.model_id)
        finally:
            receiving.cancel()  # a no-op once it returned; otherwise no receive stays behind

    async def cancel(self):
        """Tell the engine the caller left, so it drops or stops the request."""
        if self.finished:
            return
        self.finished = True
        await self.layer.send(self.engine.channel, {"type": "cancel", "id": self.request_id})


async def call(engine, endpoint, raw_body, strict, request_id, extra=None):
    """Forward a non-streamed request; returns (body, headers) or raises the engine's ApiError."""
    forwarded = Forwarded(engine, endpoint, raw_body, strict, request_id, stream=False, extra=extra)
    try:
        await forwarded.send()
        message = await forwarded.next_message()
        forwarded.finished = True
    except asyncio.CancelledError:
        await asyncio.shield(forwarded.cancel())
        raise
    finally:
        forwarded.uncount()
    if message["type"] == "error":
        raise ApiError.from_wire(message["error"])
    return message["body"], message["headers"]


async def open_stream(engine, endpoint, raw_body, strict, request_id, extra=None):
    """Forward a streamed request; returns (headers, async iterator of messages) once it starts."""
    forwarded = Forwarded(engine, endpoint, raw_body, strict, request_id, stream=True, extra=extra)
    try:
        await forwarded.send()
        first = await forwarded.next_message()
    except asyncio.CancelledError:
        forwarded.uncount()
        await asyncio.shield(forwarded.cancel())
        raise
    except BaseException:
        forwarded.uncount()
        raise
    if first["type"] == "error":
        forwarded.finished = True
        forwarded.uncount()
        raise ApiError.from_wire(first["error"])
    return first["headers"], _stream_messages(forwarded)


async def _stream_messages(forwarded):
    try:
        while True:
            message = await forwarded.next_message()
            if message["type"] == "end":
                forwarded.finished = True
                if message.get("error"):
                    raise ApiError.from_wire(message["error"])
                return
            yield message["data"]
    finally:
        forwarded.uncount()
        if not forwarded.finished:
            await asyncio.shield(forwarded.cancel())


async def control(engine, message_type, request_id, **fields):
    """A management message to the engine (load, unload, weights); returns its answer's body.
    A load or unload is acknowledged once checked and runs on in the background; a weights
    operation answers when done."""
    forwarded = Forwarded(engine, None, None, None, request_id, stream=False, extra={"type": message_type, **fields})
    try:
        await forwarded.send()
        message = await forwarded.next_message()
    finally:
        forwarded.uncount()
    forwarded.finished = True
    if message["type"] == "error":
        raise ApiError.from_wire(message["error"])
    return message["body"]


def wake_engines():
    """Best effort: tell every live engine to look at its batches now, not at its next poll."""
    layer = get_channel_layer()
    for channel in Engine.objects.live().values_list("channel", flat=True):
        try:
            async_to_sync(layer.send)(channel, {"type": "wake"})
        except Exception:
            pass  # the engine polls every BATCH_WAIT_POLL_S anyway
