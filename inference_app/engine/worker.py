"""The engine's Worker: registration, the model's advisory lock, heartbeat, and the interactive
consumer that answers what web processes forward over the Channels layer.

Small sync methods (register, try_become_active, load, heartbeat, unregister) touch the
database and return plain values, so tests call them without processes; `serve()` is the
asyncio loop that `runbatchworker` runs.

Threads: the event loop receives messages and schedules; database work runs in asgiref's one
sync thread (sync_to_async); forward passes run in the model executor, one per slot.
"""

import asyncio
import contextlib
import gc
import hashlib
import logging
import os
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import psycopg
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import IntegrityError, close_old_connections, connection, transaction
from django.utils import timezone

from inference_app import events, weight_uploads
from inference_app.catalogue import ModelSource, model_not_found, model_not_loaded, model_not_resident
from inference_app.engine import services, weights
from inference_app.engine.admission import AdmissionSlot, QueueFull
from inference_app.engine.loader import load_model
from inference_app.engine.runtime import ResidentModel
from inference_app.errors import ApiError, internal_error
from inference_app.leases import check_lease_allows
from inference_app.models import Engine, Lease, ModelEntry, Probe, new_id
from inference_app.schemas import PROBE_SCORE, decode_json, parse_request
from millm_site.db import conninfo

log = logging.getLogger("millm.engine")

STALE_ROW_RETENTION = timedelta(days=1)
SHUTDOWN_GRACE_S = 30
LAYER_RETRY_MAX_S = 2.0
LOST_LOCK_EXIT = 3  # the exit status of an engine whose model's lock another engine took


def advisory_key(model_id):
    """A stable signed 64-bit key for the model's PostgreSQL advisory lock."""
    return int.from_bytes(hashlib.sha256(f"millm-engine:{model_id}".encode()).digest()[:8], "big", signed=True)


class Worker:
    def __init__(self, source, jobs=(), companions=()):
        """`jobs`: (name, interval in seconds, sync callable) run at start-up and then on that
        interval, in the database thread (file retention is one).
        `companions`: factories called with this worker, giving objects with a sync
        `reconcile()` (run once the engine is active and its model loaded) and an async `run()`
        (the batch runner is one). inference_app never imports them."""
        self.source = source
        self.jobs = list(jobs)
        self.companions = [factory(self) for factory in companions]
        self.engine_id = new_id("eng_")
        self.channel = f"{settings.CHANNEL_PREFIX}.engine.{self.engine_id}"
        self.slot = AdmissionSlot(settings.MAX_CONCURRENT_REQUESTS, settings.MAX_PENDING_REQUESTS)
        self.executor = ThreadPoolExecutor(settings.MAX_CONCURRENT_REQUESTS, thread_name_prefix="model")
        self.runtime = None
        self.weights_torn = False  # mirrors the resident entry's weights_state (SPEC 5, "Weights")
        self.loading_model_id = None
        self.swap_lock = None
        self.role = Engine.Role.STANDBY
        self.requests = {}
        self.stopping = None
        self.lost_lock = False
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
        standby learns it may take over. While PostgreSQL is unreachable (a restart cut the
        connection), False: the connection is made again at the next call.
        """
        try:
            return self._take_lock()
        except psycopg.Error as error:
            log.warning("could not ask PostgreSQL for the lock of %s: %s", self.source.model_id, error)
            return False

    def _take_lock(self):
        """True if the lock is ours; raises psycopg.Error when PostgreSQL cannot be reached."""
        try:
            if self._lock_connection is None:
                self._lock_connection = psycopg.connect(conninfo(), autocommit=True, connect_timeout=5)
            row = self._lock_connection.execute(
                "SELECT pg_try_advisory_lock(%s)", [advisory_key(self.source.model_id)]
            ).fetchone()
            return bool(row[0])
        except psycopg.Error:
            self._drop_lock_connection()
            raise

    def still_active(self):
        """An active engine's check at every heartbeat: do we still hold the model's lock?

        A PostgreSQL restart cuts the lock's connection, and so frees the lock: take it again at
        once. False when a standby took it first: that engine is the active one now.
        """
        if self.role != Engine.Role.ACTIVE:
            return True
        if self._lock_connection is not None:
            try:
                self._lock_connection.execute("SELECT 1")
                return True
            except psycopg.Error:
                log.warning("the connection holding the lock of %s was lost; taking the lock again", self.source.model_id)
                self._drop_lock_connection()
        try:
            held = self._take_lock()
        except psycopg.Error:
            return True  # PostgreSQL is still down: no other engine can take the lock meanwhile
        if held:
            log.info("engine %s holds the lock of %s again", self.engine_id, self.source.model_id)
        return held

    def _drop_lock_connection(self):
        if self._lock_connection is not None:
            try:
                self._lock_connection.close()
            except psycopg.Error:
                pass
            self._lock_connection = None

    def activate(self):
        """Start-up, once the advisory lock is ours: end the leases a restart ends, and correct
        the catalogue states a dead engine left."""
        # A restart ends every lease: they are deleted, so a renew answers 404 lease_not_found.
        live = list(Engine.objects.live().values_list("pk", flat=True))
        Lease.objects.filter(model_id=self.source.model_id).delete()
        Lease.objects.exclude(engine_id__in=live).delete()
        serving = Engine.objects.live().exclude(resident_model_id=None).values_list("resident_model_id", flat=True)
        ModelEntry.objects.filter(state__in=["resident", "loading", "unloading"]).exclude(id__in=list(serving)).update(
            state=ModelEntry.State.AVAILABLE
        )
        # We hold the model's lock, so another row active for this model is a dead process (or one
        # that lost the lock and is stopping): it serves nothing from now on, whatever its last
        # heartbeat says, and requests are not routed to it while it goes stale.
        Engine.objects.filter(model_id=self.source.model_id, role=Engine.Role.ACTIVE).exclude(pk=self.engine_id).update(
            role=Engine.Role.STANDBY, resident_model_id=None, loading_model_id=None
        )
        self.role = Engine.Role.ACTIVE
        Engine.objects.filter(pk=self.engine_id).update(role=Engine.Role.ACTIVE, heartbeat_at=timezone.now())

    def load(self, model_id=None, startup=False):
        """Make `model_id` (default: the engine's own model) the resident model.

        1. Unload the resident model, if any (its leases end).
        2. Mark the entry loading, load through the production loader (a checkpoint: its base
           model, then its tensors over it), mark it resident.
        3. Weights: a load makes them clean, except the start-up load, which keeps a torn state
           an engine killed mid-edit left (only a load or a late commit ends it).
        """
        entry, source = self._entry_and_source(model_id)
        self.unload_resident("the model was swapped out")
        ModelEntry.objects.filter(pk=entry.pk).update(state=ModelEntry.State.LOADING, state_detail="")
        Engine.objects.filter(pk=self.engine_id).update(loading_model_id=entry.pk)
        close_old_connections()
        try:
            loaded = load_model(source)
            if entry.kind == ModelEntry.Kind.CHECKPOINT:
                weights.apply_checkpoint(loaded.model, entry.source)
                loaded.revision = entry.revision
        except Exception as error:
            ModelEntry.objects.filter(pk=entry.pk).update(state=ModelEntry.State.ERROR, state_detail=str(error)[:2000])
            Engine.objects.filter(pk=self.engine_id).update(loading_model_id=None)
            raise
        close_old_connections()
        self.runtime = ResidentModel(loaded, model_id=entry.pk)
        torn = startup and entry.weights_state == ModelEntry.Weights.TORN
        self.weights_torn = torn
        if torn:
            log.warning("the weights of %s were left torn (an edit began and never committed): "
                        "no request or batch row runs until a load or a commit", entry.pk)
        ModelEntry.objects.filter(pk=entry.pk).update(
            weights_state=ModelEntry.Weights.TORN if torn else ModelEntry.Weights.CLEAN,
            state=ModelEntry.State.RESIDENT,
            revision=loaded.revision,
            dtype=self.runtime.dtype_name,
            context_length=self.runtime.context_length,
            hidden_size=self.runtime.hidden_size,
            num_layers=self.runtime.num_layers,
        )
        Engine.objects.filter(pk=self.engine_id).update(
            role=Engine.Role.ACTIVE, resident_model_id=entry.pk, loading_model_id=None, heartbeat_at=timezone.now(),
            weights_state=ModelEntry.Weights.TORN if torn else ModelEntry.Weights.CLEAN,
        )
        self.role = Engine.Role.ACTIVE
        return self.runtime

    def _entry_and_source(self, model_id):
        if model_id is None or model_id == self.source.model_id:
            entry, _ = ModelEntry.objects.update_or_create(
                id=self.source.model_id,
                defaults={
                    "source": str(self.source.path),
                    "source_format": self.source.format,
                    "quantization": self.source.quantization,
                },
            )
            return entry, self.source
        entry = ModelEntry.objects.get(pk=model_id)
        weights_of = entry.root  # a checkpoint loads its base model first
        return entry, ModelSource(Path(weights_of.source), weights_of.source_format, entry.pk, weights_of.quantization)

    def unload_resident(self, reason):
        """Drop the resident model: its leases end and its entry is available again."""
        if self.runtime is None:
            return
        model_id = self.runtime.model_id
        self.runtime = None
        gc.collect()
        if torch_cuda_available():
            import torch

            torch.cuda.empty_cache()
        Lease.objects.filter(model_id=model_id).end_all(reason)
        Engine.objects.filter(pk=self.engine_id).update(resident_model_id=None)
        if not Engine.objects.live().exclude(pk=self.engine_id).filter(resident_model_id=model_id).exists():
            ModelEntry.objects.filter(pk=model_id).update(state=ModelEntry.State.AVAILABLE)

    def probes_for(self, request):
        """The probe specs a probe-score request scores, checked against the resident model."""
        model_id = self.runtime.model_id
        if request.probe_ids:
            found = {probe.pk: probe for probe in Probe.objects.filter(pk__in=request.probe_ids)}
            missing = [probe_id for probe_id in request.probe_ids if probe_id not in found]
            if missing:
                raise ApiError(404, "probe_not_found", f"No probe has the id '{missing[0]}'", param="probe_ids")
            probes = [found[probe_id] for probe_id in request.probe_ids]
            wrong = [probe for probe in probes if probe.model_id != model_id]
            if wrong:
                raise ApiError(
                    409,
                    "probe_model_mismatch",
                    f"Probe '{wrong[0].pk}' was made for '{wrong[0].model_id}', but the resident model is '{model_id}'",
                    details={"mismatches": [{"field": "model", "expected": model_id, "actual": wrong[0].model_id}]},
                )
        else:
            probes = list(Probe.objects.filter(model_id=model_id).order_by("created_at")[: settings.PROBE_SCORE_MAX_PROBES])
            if not probes:
                raise ApiError(
                    400,
                    "invalid_probe_score_request",
                    f"The resident model '{model_id}' has no probes; import one with POST /api/probes",
                    details={"field": "probe_ids"},
                )
        return [probe.spec() for probe in probes]

    def heartbeat(self):
        close_old_connections()
        runtime = self.runtime
        figures = {
            "heartbeat_at": timezone.now(),
            "role": self.role,
            "resident_model_id": runtime.model_id if runtime else None,
            "loading_model_id": self.loading_model_id,
            "weights_state": Engine.Weights.TORN if runtime and self.weights_torn else Engine.Weights.CLEAN,
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
        self.unload_resident("the engine stopped")
        Engine.objects.filter(pk=self.engine_id).delete()
        if self._lock_connection is not None:
            self._lock_connection.close()
            self._lock_connection = None

    # --- the loop ---

    def run(self):
        asyncio.run(self.serve())
        if self.lost_lock:
            raise SystemExit(LOST_LOCK_EXIT)

    async def serve(self):
        """1. Register as a standby and start the heartbeat.
        2. Wait for the model's advisory lock (another engine may hold it), then load.
        3. Answer forwarded requests until SIGTERM; then finish what is in flight and leave."""
        self.stopping = asyncio.Event()
        self.nappers = set()
        self.swap_lock = asyncio.Lock()
        self._install_signal_handlers()
        await sync_to_async(self.register)()
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        jobs = [asyncio.create_task(self._job_loop(*job)) for job in self.jobs]
        try:
            if not await self._wait_for_lock():
                return
            log.info("engine %s is active for %s; loading", self.engine_id, self.source.model_id)
            await sync_to_async(self.activate)()
            await self.swap(self.source.model_id, startup=True)
            log.info("engine %s serving %s on %s", self.engine_id, self.runtime.model_id, self.channel)
            for companion in self.companions:
                await sync_to_async(companion.reconcile)()
            running = [asyncio.create_task(companion.run()) for companion in self.companions]
            await self._consume()
            await self._drain()
            if running:
                await asyncio.wait(running, timeout=SHUTDOWN_GRACE_S)
        finally:
            heartbeat.cancel()
            for job in jobs:
                job.cancel()
            await sync_to_async(self.unregister)()
            self.executor.shutdown(wait=False, cancel_futures=True)
            log.info("engine %s stopped", self.engine_id)

    async def swap(self, model_id, startup=False):
        """Load `model_id` (None: unload) once the slot is free; requests queue behind it."""
        async with self.swap_lock:
            current = self.runtime.model_id if self.runtime else None
            if current == model_id:
                return
            self.loading_model_id = model_id
            if model_id:
                await self._model_event("model:load:progress", model_id, stage="waiting for the slot")
            await self.slot.acquire(interactive=True, limited=False)
            started = time.monotonic()
            try:
                if model_id:
                    await self._model_event("model:load:progress", model_id, stage="loading weights")
                await asyncio.get_running_loop().run_in_executor(self.executor, self._swap_in_thread, model_id, startup)
            except Exception as error:
                await self._model_event("model:load:error", model_id, error=str(error)[:500])
                raise
            finally:
                self.slot.release(True, None)
                self.loading_model_id = None
            seconds = round(time.monotonic() - started, 2)
            if current:
                await self._model_event("model:unload:complete", current)
            if model_id:
                await self._model_event("model:load:complete", model_id, seconds=seconds)
            log.info("engine %s: %s in %.1f s", self.engine_id,
                     f"loaded {model_id}" if model_id else f"unloaded {current}", seconds)

    async def _model_event(self, event, model_id, **fields):
        data = {"model_id": model_id, "engine": self.engine_id, **fields}
        await events.apublish(event, data, [events.MODELS_GROUP], rooms=["models"])

    def _swap_in_thread(self, model_id, startup=False):
        try:
            if model_id is None:
                self.unload_resident("the model was unloaded")
            else:
                self.load(model_id, startup=startup)
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
            await self.nap(settings.ENGINE_HEARTBEAT_S)
        return False

    async def _heartbeat_loop(self):
        while True:
            try:
                if not await sync_to_async(self.still_active)():
                    # A standby holds the lock and is the active engine now (SPEC 5: one active
                    # engine per model): stop, with a status a supervisor restarts (as a standby).
                    log.error("engine %s lost the lock of %s to another engine; stopping", self.engine_id,
                              self.source.model_id)
                    self.role = Engine.Role.STANDBY
                    self.lost_lock = True
                    self.stopping.set()
                await sync_to_async(self.heartbeat)()
            except Exception:
                log.exception("heartbeat failed; retrying")
            await asyncio.sleep(settings.ENGINE_HEARTBEAT_S)

    async def _job_loop(self, name, interval, job):
        while not self.stopping.is_set():
            try:
                outcome = await sync_to_async(job)()
                log.info("%s: %s", name, outcome)
            except Exception:
                log.exception("%s failed; it runs again in %s s", name, interval)
            with contextlib.suppress(TimeoutError):  # only a stop ends this wait early, not a wake
                await asyncio.wait_for(self.stopping.wait(), interval)

    async def nap(self, seconds):
        """Sleep up to `seconds`; a wake message (a batch was created, cancelled, handed a
        lease) or a stop ends it sooner."""
        woken = asyncio.Event()
        self.nappers.add(woken)
        waiters = {asyncio.create_task(self.stopping.wait()), asyncio.create_task(woken.wait())}
        try:
            _, pending = await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.nappers.discard(woken)
        for waiter in pending:
            waiter.cancel()

    async def _consume(self):
        layer = get_channel_layer()
        stop = asyncio.create_task(self.stopping.wait())
        layer_failures = 0
        while not self.stopping.is_set():
            receive = asyncio.create_task(layer.receive(self.channel))
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
            self.wake()
        elif kind in ("load", "unload"):
            asyncio.create_task(self._control(message))
        elif kind == "weights":
            asyncio.create_task(self._weights(message))

    async def _control(self, message):
        """A load or unload from the management routes: checked, acknowledged, then run."""
        layer = get_channel_layer()
        target = message.get("model_id") if message["type"] == "load" else None
        try:
            current = self.runtime.model_id if self.runtime else None
            if target is not None and not await sync_to_async(ModelEntry.objects.filter(pk=target).exists)():
                raise model_not_found(target, f"The model '{target}' is not in the catalogue")
            if target != current:
                action = "loading another model" if target else "unloading it"
                await sync_to_async(check_lease_allows)(current, message.get("lease"), action)
        except ApiError as error:
            await _send(layer, message["reply"], {"type": "error", "error": error.to_wire()})
            return
        await _send(layer, message["reply"], {"type": "result", "body": {"engine": self.engine_id}, "headers": {}})
        try:
            await self.swap(target)
        except Exception:
            log.exception("%s of %s failed", message["type"], target or current)

    async def _weights(self, message):
        """A weights begin, write, commit or save: the model must be resident here and another
        holder's lease refuses it; it runs under the slot (so no forward pass sees half a write)
        and no swap runs meanwhile; answered when done."""
        layer = get_channel_layer()
        op, model_id = message["op"], message["model_id"]
        try:
            async with self.swap_lock:
                current = self.runtime.model_id if self.runtime else None
                if current != model_id:
                    raise model_not_resident(model_id, current)
                await sync_to_async(check_lease_allows)(model_id, message.get("lease"), WEIGHT_ACTIONS[op])
                async with self.slot.hold(interactive=True, limited=False):
                    body = await asyncio.get_running_loop().run_in_executor(
                        self.executor, self._weights_in_thread, op, message
                    )
        except ApiError as error:
            await _send(layer, message["reply"], {"type": "error", "error": error.to_wire()})
            return
        except Exception:
            log.exception("weights %s on %s failed", op, model_id)
            await _send(layer, message["reply"], {"type": "error", "error": internal_error().to_wire()})
            return
        await _send(layer, message["reply"], {"type": "result", "body": body, "headers": {}})
        if op == "save":
            await self._model_event("model:save:complete", body["model"], renamed_from=model_id)
        if op in ("commit", "save"):
            self.wake()

    def _weights_in_thread(self, op, message):
        try:
            runtime = self.runtime
            if op == "begin":
                self._set_weights_state(runtime.model_id, torn=True)
                return {"model": runtime.model_id, "weights": ModelEntry.Weights.TORN}
            if op == "commit":
                self._set_weights_state(runtime.model_id, torn=False)
                return {"model": runtime.model_id, "weights": ModelEntry.Weights.CLEAN}
            if op == "write":
                if not self.weights_torn:
                    raise ApiError(
                        409, "weights_not_begun",
                        f"Begin the edit first: POST /api/models/{runtime.model_id}/weights/begin, then PUT, then commit",
                    )
                tensors = weights.read_tensors(weight_uploads.read(message["upload"]))
                written = weights.write(runtime.model, tensors)
                log.info("wrote %d tensor(s) of %s", len(written), runtime.model_id)
                return {"model": runtime.model_id, "weights": ModelEntry.Weights.TORN, "written": written}
            if self.weights_torn:
                raise weights_torn(runtime.model_id)
            return self._save(runtime)
        finally:
            connection.close()  # this thread's connection; the DB thread keeps its own

    def _set_weights_state(self, model_id, torn):
        state = ModelEntry.Weights.TORN if torn else ModelEntry.Weights.CLEAN
        ModelEntry.objects.filter(pk=model_id).update(weights_state=state)
        Engine.objects.filter(pk=self.engine_id).update(weights_state=state)
        self.weights_torn = torn
        log.info("the weights of %s are %s", model_id, state)

    def _save(self, runtime):
        """Write the resident weights as a new checkpoint, which the resident model becomes: the
        id it had stops resolving to them (SPEC 5). Leases on it follow the weights."""
        previous = ModelEntry.objects.get(pk=runtime.model_id)
        # The tensors are written first, outside any transaction; the entry and the rename of
        # the staged folder to its id's folder are one short transaction.
        staged, revision = weights.stage(runtime.model, settings.MILLM_DATA_DIR)

        def path_of(model_id):
            return weights.checkpoint_folder(settings.MILLM_DATA_DIR, model_id) / weights.CHECKPOINT_FILE

        try:
            for attempt in range(3):
                try:
                    with transaction.atomic():
                        checkpoint = previous.new_checkpoint(path_of, revision)
                        path = Path(checkpoint.source)
                        # The id is ours now: a folder already there is a crash's leftover.
                        shutil.rmtree(path.parent, ignore_errors=True)
                        os.rename(staged, path.parent)
                    break
                except IntegrityError:
                    if attempt == 2:
                        raise  # another engine saved checkpoints of the same base three times meanwhile
        finally:
            shutil.rmtree(staged, ignore_errors=True)  # gone already, unless the entry was not made
        runtime.rename(checkpoint.pk, revision)
        Lease.objects.live().filter(model_id=previous.pk).update(model_id=checkpoint.pk)
        Engine.objects.filter(pk=self.engine_id).update(resident_model_id=checkpoint.pk)
        if not Engine.objects.live().exclude(pk=self.engine_id).filter(resident_model_id=previous.pk).exists():
            ModelEntry.objects.filter(pk=previous.pk).update(state=ModelEntry.State.AVAILABLE)
        log.info("saved the weights of %s as %s (%s)", previous.pk, checkpoint.pk, path)
        return {"model": checkpoint.pk, "base": checkpoint.base_id, "renamed_from": previous.pk,
                "revision": revision, "path": str(path)}

    def wake(self):
        for woken in self.nappers:
            woken.set()

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
            probes = None
            while True:
                if parsed.endpoint == PROBE_SCORE:
                    if self.runtime is None:
                        raise model_not_loaded()
                    probes = await sync_to_async(self.probes_for)(parsed.request)
                    wanted = self.runtime.model_id
                else:
                    wanted = parsed.request.model
                    await self._ensure_model(wanted, message)
                if self.weights_torn:
                    raise weights_torn(wanted)
                remaining = message["deadline"] - time.time()
                if remaining <= 0:
                    return  # the caller has already been told it timed out
                try:
                    async with asyncio.timeout(remaining):
                        await self.slot.acquire(interactive=True)
                except TimeoutError:
                    log.info("dropped request %s: its timeout passed while it waited", message["id"])
                    return
                if self.runtime is not None and self.runtime.model_id == wanted:
                    break
                self.slot.release(True, None)  # a swap ran while we waited: check again
            started = time.monotonic()
            try:
                if self.weights_torn:
                    raise weights_torn(wanted)
                flight.running = True
                await self._run_in_model_thread(message, parsed, flight, reply, probes)
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

    async def _ensure_model(self, model_id, message):
        """Make `model_id` resident for a /v1 request: wait for a swap to it, or (load policy
        auto, no other holder's lease) swap to it; a batch never calls this."""
        while not (self.runtime is not None and self.runtime.model_id == model_id):
            if self.swap_lock.locked():
                async with self.swap_lock:
                    continue
            entry = await sync_to_async(ModelEntry.objects.filter(pk=model_id).first)()
            if entry is None:
                raise model_not_found(model_id, f"The model '{model_id}' does not exist")
            if entry.kind == ModelEntry.Kind.CHECKPOINT:
                raise model_not_found(model_id, f"The checkpoint '{model_id}' is not resident; a request never loads a checkpoint")
            current = self.runtime.model_id if self.runtime else None
            if message.get("load_policy") == "refuse":
                raise model_not_resident(model_id, current)
            await sync_to_async(check_lease_allows)(current, message.get("lease"), "loading another model")
            try:
                await self.swap(model_id)
            except Exception as error:
                raise ApiError(503, "model_not_loaded", f"Loading '{model_id}' failed: {error}", retry_after=5) from error

    async def _run_in_model_thread(self, message, parsed, flight, reply, probes=None):
        loop = asyncio.get_running_loop()
        if message.get("stream"):
            work = loop.run_in_executor(self.executor, self._pump_stream, parsed, flight.cancelled, reply, loop)
        else:
            work = loop.run_in_executor(
                self.executor, services.run, self.runtime, parsed, flight.cancelled.is_set, probes
            )
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


WEIGHT_ACTIONS = {
    "begin": "editing its weights",
    "write": "writing its weights",
    "commit": "committing its weights",
    "save": "saving its weights",
}


def weights_torn(model_id):
    return ApiError(
        409,
        "weights_torn",
        f"The resident weights of '{model_id}' are mid-write: an edit began and has not been committed. "
        f"Retry after POST /api/models/{model_id}/weights/commit (or a load of the model).",
        param="model",
    )


def torch_cuda_available():
    import torch

    return torch.cuda.is_available()


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
