"""The engine's serving room: the interactive consumer that answers what web processes forward
over the Channels layer.

`Serving.consume()` receives on the engine's channel until the engine stops and dispatches each
message: an inference request becomes a task (`requests`, by id, so that a `cancel` finds it);
load, unload and weights messages go to the residency room; `wake` ends the runner's naps.

Threads: the event loop receives messages and schedules; database work runs in asgiref's one
sync thread (sync_to_async); forward passes run in the model executor, one per slot. The slot is
held until the model thread finishes, even if the request's task is cancelled meanwhile.
"""

import asyncio
import logging
import threading
import time

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from inference_app.catalogue import check_request_may_load, model_not_found, model_not_loaded
from inference_app.engine import services
from inference_app.engine.admission import QueueFull
from inference_app.engine.seating import NOT_RUN
from millm_lib.errors import ApiError, internal_error
from inference_app.leases import check_lease_allows
from inference_app.models import ModelEntry
from millm_lib.jsonbody import decode_json
from inference_app.schemas import parse_request
from millm_lib.limits import PROBE_SCORE
from projects_app.models import Project

log = logging.getLogger("millm.engine")

SHUTDOWN_GRACE_S = 30
LAYER_RETRY_MAX_S = 2.0


def _callers_probes(worker, request, project_id):
    """The probes a forwarded probe score scores: its caller's own (`project_id`, as web sent it)."""
    return worker.probes_for(request, Project.objects.calling(project_id))


class Serving:
    """Forwarded requests: `requests` holds the ones in flight (waiting or running), by id."""

    def __init__(self, worker):
        self.worker = worker
        self.requests = {}

    async def consume(self):
        worker = self.worker
        layer = get_channel_layer()
        stop = asyncio.create_task(worker.stopping.wait())
        layer_failures = 0
        while not worker.stopping.is_set():
            receive = asyncio.create_task(layer.receive(worker.channel))
            done, _ = await asyncio.wait({receive, stop}, return_when=asyncio.FIRST_COMPLETED)
            if receive not in done:
                receive.cancel()
                break
            try:
                message = receive.result()
            except Exception as error:
                # Redis is down or restarting: wait a little (longer each time, up to
                # LAYER_RETRY_MAX_S) instead of spinning, then receive again.
                layer_failures += 1
                delay = min(LAYER_RETRY_MAX_S, 0.1 * 2 ** min(layer_failures - 1, 5))
                log.warning("the channel layer failed (%s); receiving again in %.1f s", error, delay,
                            exc_info=layer_failures == 1)
                await asyncio.wait({stop}, timeout=delay)
                continue
            if layer_failures:
                log.info("the channel layer is back after %d failed receive(s)", layer_failures)
                layer_failures = 0
            try:
                self._dispatch(message)
            except Exception:
                log.exception("could not dispatch a message")
        stop.cancel()

    def _dispatch(self, message):
        kind = message.get("type")
        if kind == "infer":
            task = asyncio.create_task(self._answer(message))
            self.requests[message["id"]] = _InFlight(task)
            task.add_done_callback(lambda _: self.requests.pop(message["id"], None))
        elif kind == "cancel":
            self.cancel(message["id"])
        elif kind == "wake":
            self.worker.wake()
        elif kind in ("load", "unload"):
            asyncio.create_task(self.worker.residency.control(message))
        elif kind == "weights":
            asyncio.create_task(self.worker.residency.edit_weights(message))

    def cancel(self, request_id):
        """The caller left: drop the request if it waits; stop generating if it runs."""
        flight = self.requests.get(request_id)
        if flight is None:
            return
        flight.cancelled.set()
        if not flight.running:
            flight.task.cancel()

    async def drain(self):
        pending = [flight.task for flight in self.requests.values()]
        if pending:
            log.info("finishing %d request(s) in flight", len(pending))
            await asyncio.wait(pending, timeout=SHUTDOWN_GRACE_S)

    async def _answer(self, message):
        worker = self.worker
        reply = message["reply"]
        layer = get_channel_layer()
        flight = self.requests.get(message["id"]) or _InFlight(None)
        try:
            parsed = parse_request(message["endpoint"], decode_json(message["body"]), message["strict"])
            # A generation request takes one seat in the step scheduler; the rest the whole model.
            shared = worker.seating.batched and services.is_generation(parsed)
            probes = None
            while True:
                if parsed.endpoint == PROBE_SCORE:
                    if worker.runtime is None:
                        raise model_not_loaded()
                    probes = await sync_to_async(_callers_probes)(worker, parsed.request, message.get("project"))
                    wanted = worker.runtime.model_id
                else:
                    wanted = parsed.request.model
                    await self._ensure_model(wanted, message)
                if worker.weights_torn:
                    raise weights_torn(wanted)
                if message["deadline"] <= time.time():
                    return  # the caller has already been told it timed out
                try:
                    result = await self._run(message, parsed, flight, reply, probes, wanted, shared)
                except TimeoutError:
                    log.info("dropped request %s: its timeout passed while it waited", message["id"])
                    return
                if result is not NOT_RUN:
                    break
                # A swap or an edit took the slot first: check the model again.
            if not message.get("stream"):
                await send_to(layer, reply, {"type": "result", "body": result.body, "headers": result.headers})
        except QueueFull as full:
            await send_to(layer, reply, {"type": "error", "error": _queue_full(full).to_wire()})
        except ApiError as error:
            await send_to(layer, reply, {"type": "error", "error": error.to_wire()})
        except asyncio.CancelledError:
            log.info("dropped request %s: its caller left", message["id"])
        except Exception:
            log.exception("request %s failed", message["id"])
            await send_to(layer, reply, {"type": "error", "error": internal_error().to_wire()})

    async def _ensure_model(self, model_id, message):
        """Make `model_id` resident for a /v1 request: wait for a swap to it, or (load policy
        auto, no other holder's lease) swap to it; a batch never calls this."""
        residency = self.worker.residency
        while not (residency.runtime is not None and residency.runtime.model_id == model_id):
            if residency.swap_lock.locked():
                async with residency.swap_lock:
                    continue
            entry = await sync_to_async(ModelEntry.objects.filter(pk=model_id).first)()
            if entry is None:
                raise model_not_found(model_id, f"The model '{model_id}' does not exist")
            current = residency.runtime.model_id if residency.runtime else None
            check_request_may_load(entry, message.get("load_policy"), current)
            await sync_to_async(check_lease_allows)(current, message.get("lease"), "loading another model",
                                                     message.get("project"))
            try:
                await residency.swap(model_id)
            except Exception as error:
                raise ApiError(503, "model_not_loaded", f"Loading '{model_id}' failed: {error}", retry_after=5) from error

    async def _run(self, message, parsed, flight, reply, probes, wanted, shared):
        """The service function through Seating: in the model thread, or (`shared`) in a service
        thread with a seated runtime. The hold lasts until the thread is done, even if this task is
        cancelled meanwhile (then the request's `cancelled` is set first). NOT_RUN when `wanted`
        is not resident with clean weights once the hold is granted."""
        if message.get("stream"):
            work = (self._pump_stream, parsed, flight.cancelled, reply, asyncio.get_running_loop())
        else:
            work = (services.run, parsed, flight.cancelled.is_set, probes)

        def started():
            flight.running = True

        return await self.worker.seating.run(wanted, *work, interactive=True, shared=shared,
                                             cancelled=flight.cancelled, deadline=message["deadline"], on_start=started,
                                             choices=getattr(parsed.request, "n", 1),
                                             reuse_prefix=settings.MILLM_PREFIX_REUSE)

    def _pump_stream(self, runtime, parsed, cancelled, reply, loop):
        """Runs in the model or a service thread: generate chunks and send each as it is made.

        A seated stream's headers wait for its first token: X-miLLM-Backend says then whether
        another sequence decodes beside it."""
        layer = get_channel_layer()

        def send(message):
            asyncio.run_coroutine_threadsafe(send_to(layer, reply, message), loop).result(timeout=30)

        try:
            headers, chunks = services.stream(runtime, parsed, cancelled.is_set)
        except ApiError as error:
            send({"type": "error", "error": error.to_wire()})
            return
        started, sent = False, 0
        try:
            for chunk in _until_first_token(runtime, chunks):
                if not started:
                    if getattr(runtime, "shared_at_first_token", False):
                        headers["X-miLLM-Backend"] = "batched"
                    send({"type": "start", "headers": headers})
                    started = True
                if cancelled.is_set():
                    log.info("stopped streaming: its caller left after %d chunk(s)", sent)
                    return
                send({"type": "chunk", "data": chunk})
                sent += 1
            send({"type": "end"})
        except ApiError as error:
            send({"type": "end", "error": error.to_wire()} if started else {"type": "error", "error": error.to_wire()})
        except Exception:
            log.exception("stream failed")
            failure = internal_error().to_wire()
            send({"type": "end", "error": failure} if started else {"type": "error", "error": failure})


def _until_first_token(runtime, chunks):
    """The chunks, the first of them held back until a seated runtime's sequence has made its
    first token (or the stream ended): until then nobody knows whether it shares its steps."""
    held = []
    sequences = getattr(runtime, "sequences", None)
    for chunk in chunks:
        if sequences is None or (sequences and sequences[0].produced):
            yield from held
            held = []
            yield chunk
        else:
            held.append(chunk)
    yield from held


class _InFlight:
    def __init__(self, task):
        self.task = task
        self.cancelled = threading.Event()
        self.running = False


def weights_torn(model_id):
    return ApiError(
        409,
        "weights_torn",
        f"The resident weights of '{model_id}' are mid-write: an edit began and has not been committed. "
        f"Retry after POST /api/models/{model_id}/weights/commit (or a load of the model).",
        param="model",
    )


def _queue_full(full):
    return ApiError(
        503,
        "queue_full",
        f"The engine's queue is full: {full.pending} requests are waiting or running and "
        f"MAX_PENDING_REQUESTS is {full.max_pending}{full.beside_seats}. Retry after {full.retry_after} s.",
        retry_after=full.retry_after,
    )


async def send_to(layer, channel, message):
    """Send on the channel layer; a caller that left is logged, not raised."""
    try:
        await layer.send(channel, message)
    except Exception:
        log.warning("could not send to %s (the caller may have left)", channel, exc_info=True)
