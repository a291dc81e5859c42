"""The engine's Worker: registration, the model's advisory lock, heartbeat, and the interactive
consumer that answers what web processes forward over the Channels layer.

Small sync methods (register, try_become_active, load, heartbeat, unregister) touch the
database and return plain values, so tests call them without processes; `serve()` is the
asyncio loop that `runbatchworker` runs.

Threads: the event loop receives messages and schedules; database work runs in asgiref's one
sync thread (sync_to_async); forward passes run in the model executor, one per slot.
"""

import asyncio
import hashlib
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import psycopg
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from inference_app.engine import services
from inference_app.engine.admission import AdmissionSlot, QueueFull
from inference_app.engine.loader import load_model
from inference_app.engine.runtime import ResidentModel
from inference_app.errors import ApiError, internal_error
from inference_app.models import Engine, ModelEntry, new_id
from inference_app.schemas import decode_json, parse_request
from millm_site.db import conninfo

log = logging.getLogger("millm.engine")

STALE_ROW_RETENTION = timedelta(days=1)
SHUTDOWN_GRACE_S = 30


def advisory_key(model_id):
    """A stable signed 64-bit key for the model's PostgreSQL advisory lock."""
    return int.from_bytes(hashlib.sha256(f"millm-engine:{model_id}".encode()).digest()[:8], "big", signed=True)


class Worker:
    def __init__(self, source):
        self.source = source
        self.engine_id = new_id("eng_")
        self.channel = f"{settings.CHANNEL_PREFIX}.engine.{self.engine_id}"
        self.slot = AdmissionSlot(settings.MAX_CONCURRENT_REQUESTS, settings.MAX_PENDING_REQUESTS)
        self.executor = ThreadPoolExecutor(settings.MAX_CONCURRENT_REQUESTS, thread_name_prefix="model")
        self.runtime = None
        self.role = Engine.Role.STANDBY
        self.requests = {}
        self.stopping = None
        self._lock_connection = None

    # --- database steps (sync) ---

    def register(self):
        Engine.objects.filter(heartbeat_at__lt=timezone.now() - STALE_ROW_RETENTION).delete()
        return Engine.objects.create(
            id=self.engine_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            channel=self.channel,
            model_id=self.source.model_id,
            role=Engine.Role.STANDBY,
            queue_max_concurrent=self.slot.slots,
            queue_max_pending=self.slot.max_pending,
        )

    def try_become_active(self):
        """Take the model's advisory lock on a connection held for the engine's lifetime.

        A session-level lock: PostgreSQL releases it when this process dies, which is how a
        standby learns it may take over.
        """
        if self._lock_connection is None:
            self._lock_connection = psycopg.connect(conninfo(), autocommit=True)
        row = self._lock_connection.execute(
            "SELECT pg_try_advisory_lock(%s)", [advisory_key(self.source.model_id)]
        ).fetchone()
        return bool(row[0])

    def load(self):
        """Load the model, mark it resident in the catalogue, and become the active engine."""
        entry, _ = ModelEntry.objects.update_or_create(
            id=self.source.model_id,
            defaults={
                "kind": ModelEntry.Kind.CATALOGUE,
                "source": str(self.source.path),
                "source_format": self.source.format,
                "quantization": self.source.quantization,
                "state": ModelEntry.State.LOADING,
                "state_detail": "",
            },
        )
        close_old_connections()
        try:
            loaded = load_model(self.source)
        except Exception as error:
            ModelEntry.objects.filter(pk=entry.pk).update(state=ModelEntry.State.ERROR, state_detail=str(error)[:2000])
            raise
        close_old_connections()
        self.runtime = ResidentModel(loaded)
        ModelEntry.objects.filter(pk=entry.pk).update(
            state=ModelEntry.State.RESIDENT,
            revision=loaded.revision,
            dtype=self.runtime.dtype_name,
            context_length=self.runtime.context_length,
        )
        self.role = Engine.Role.ACTIVE
        Engine.objects.filter(pk=self.engine_id).update(
            role=Engine.Role.ACTIVE, resident_model_id=self.runtime.model_id, heartbeat_at=timezone.now()
        )
        return self.runtime

    def heartbeat(self):
        close_old_connections()
        figures = {
            "heartbeat_at": timezone.now(),
            "role": self.role,
            "resident_model_id": self.runtime.model_id if self.runtime else None,
            "queue_waiting": self.slot.waiting,
            "in_flight": self.slot.holding,
            "estimated_wait_seconds": self.slot.estimated_wait_seconds(),
        }
        if not Engine.objects.filter(pk=self.engine_id).update(**figures):
            # Someone deleted our row (an operator, a test flush): register again.
            self.register()
            Engine.objects.filter(pk=self.engine_id).update(**figures)

    def unregister(self):
        close_old_connections()
        Engine.objects.filter(pk=self.engine_id).delete()
        if self.runtime is not None and not Engine.objects.live().filter(resident_model_id=self.runtime.model_id):
            ModelEntry.objects.filter(pk=self.runtime.model_id, state=ModelEntry.State.RESIDENT).update(
                state=ModelEntry.State.AVAILABLE
            )
        if self._lock_connection is not None:
            self._lock_connection.close()
            self._lock_connection = None

    # --- the loop ---

    def run(self):
        asyncio.run(self.serve())

    async def serve(self):
        """1. Register as a standby and start the heartbeat.
        2. Wait for the model's advisory lock (another engine may hold it), then load.
        3. Answer forwarded requests until SIGTERM; then finish what is in flight and leave."""
        self.stopping = asyncio.Event()
        self._install_signal_handlers()
        await sync_to_async(self.register)()
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        try:
            if not await self._wait_for_lock():
                return
            log.info("engine %s is active for %s; loading", self.engine_id, self.source.model_id)
            await asyncio.get_running_loop().run_in_executor(self.executor, self._load_in_thread)
            log.info("engine %s serving %s on %s", self.engine_id, self.runtime.model_id, self.channel)
            await self._consume()
            await self._drain()
        finally:
            heartbeat.cancel()
            await sync_to_async(self.unregister)()
            self.executor.shutdown(wait=False, cancel_futures=True)
            log.info("engine %s stopped", self.engine_id)

    def _load_in_thread(self):
        try:
            self.load()
        finally:
            connection.close()  # this thread's connection; the DB thread keeps its own

    async def _wait_for_lock(self):
        announced = False
        while not self.stopping.is_set():
            if await sync_to_async(self.try_become_active)():
                return True
            if not announced:
                log.info("engine %s is a standby: another engine holds %s", self.engine_id, self.source.model_id)
                announced = True
            await self._sleep_unless_stopping(settings.ENGINE_HEARTBEAT_S)
        return False

    async def _heartbeat_loop(self):
        while True:
            try:
                await sync_to_async(self.heartbeat)()
            except Exception:
                log.exception("heartbeat failed; retrying")
            await asyncio.sleep(settings.ENGINE_HEARTBEAT_S)

    async def _sleep_unless_stopping(self, seconds):
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        except TimeoutError:
            pass

    async def _consume(self):
        layer = get_channel_layer()
        stop = asyncio.create_task(self.stopping.wait())
        while not self.stopping.is_set():
            receive = asyncio.create_task(layer.receive(self.channel))
            done, _ = await asyncio.wait({receive, stop}, return_when=asyncio.FIRST_COMPLETED)
            if receive not in done:
                receive.cancel()
                break
            try:
                self._dispatch(receive.result())
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

    def cancel(self, request_id):
        """The caller left: drop the request if it waits; stop generating if it runs."""
        flight = self.requests.get(request_id)
        if flight is None:
            return
        flight.cancelled.set()
        if not flight.running:
            flight.task.cancel()

    async def _drain(self):
        pending = [flight.task for flight in self.requests.values()]
        if pending:
            log.info("finishing %d request(s) in flight", len(pending))
            await asyncio.wait(pending, timeout=SHUTDOWN_GRACE_S)

    async def _answer(self, message):
        reply = message["reply"]
        layer = get_channel_layer()
        flight = self.requests.get(message["id"]) or _InFlight(None)
        try:
            parsed = parse_request(message["endpoint"], decode_json(message["body"]), message["strict"])
            remaining = message["deadline"] - time.time()
            if remaining <= 0:
                return  # the caller has already been told it timed out
            try:
                async with asyncio.timeout(remaining):
                    await self.slot.acquire(interactive=True)
            except TimeoutError:
                log.info("dropped request %s: its timeout passed while it waited", message["id"])
                return
            started = time.monotonic()
            try:
                flight.running = True
                await self._run_in_model_thread(message, parsed, flight, reply)
            finally:
                self.slot.release(True, time.monotonic() - started)
        except QueueFull as full:
            await _send(layer, reply, {"type": "error", "error": _queue_full(full).to_wire()})
        except ApiError as error:
            await _send(layer, reply, {"type": "error", "error": error.to_wire()})
        except asyncio.CancelledError:
            log.info("dropped request %s: its caller left", message["id"])
        except Exception:
            log.exception("request %s failed", message["id"])
            await _send(layer, reply, {"type": "error", "error": internal_error().to_wire()})

    async def _run_in_model_thread(self, message, parsed, flight, reply):
        loop = asyncio.get_running_loop()
        if message.get("stream"):
            work = loop.run_in_executor(self.executor, self._pump_stream, parsed, flight.cancelled, reply, loop)
        else:
            work = loop.run_in_executor(self.executor, services.run, self.runtime, parsed, flight.cancelled.is_set)
        # The slot is held until the thread is done, even if this task is cancelled meanwhile:
        # two forward passes must never overlap on one slot.
        try:
            result = await asyncio.shield(work)
        except asyncio.CancelledError:
            flight.cancelled.set()
            await asyncio.wait({work})
            raise
        if not message.get("stream"):
            await _send(get_channel_layer(), reply, {"type": "result", "body": result.body, "headers": result.headers})

    def _pump_stream(self, parsed, cancelled, reply, loop):
        """Runs in the model thread: generate chunks and send each as it is made."""
        layer = get_channel_layer()

        def send(message):
            asyncio.run_coroutine_threadsafe(_send(layer, reply, message), loop).result(timeout=30)

        try:
            headers, chunks = services.stream(self.runtime, parsed, cancelled.is_set)
        except ApiError as error:
            send({"type": "error", "error": error.to_wire()})
            return
        send({"type": "start", "headers": headers})
        try:
            for chunk in chunks:
                if cancelled.is_set():
                    return
                send({"type": "chunk", "data": chunk})
            send({"type": "end"})
        except ApiError as error:
            send({"type": "end", "error": error.to_wire()})
        except Exception:
            log.exception("stream failed")
            send({"type": "end", "error": internal_error().to_wire()})

    def _install_signal_handlers(self):
        loop = asyncio.get_running_loop()

        def on_signal():
            if self.stopping.is_set():
                log.warning("second signal: exiting at once")
                os._exit(1)
            log.info("stopping: no new requests; finishing those in flight")
            self.stopping.set()

        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, on_signal)


class _InFlight:
    def __init__(self, task):
        self.task = task
        self.cancelled = threading.Event()
        self.running = False


def _queue_full(full):
    return ApiError(
        503,
        "queue_full",
        f"The engine's queue is full: {full.pending} requests are waiting or running and "
        f"MAX_PENDING_REQUESTS is {full.limit}. Retry after {full.retry_after} s.",
        retry_after=full.retry_after,
    )


async def _send(layer, channel, message):
    try:
        await layer.send(channel, message)
    except Exception:
        log.warning("could not send to %s (the caller may have left)", channel, exc_info=True)
