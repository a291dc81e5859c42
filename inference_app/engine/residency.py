"""The engine's residency: which model is resident and what its weights are.

`runtime` (the `ResidentModel`, or None) and `weights_torn` (mirrors the resident entry's
weights_state, SPEC 5 "Weights") are the in-memory truth the request path and the batch runner
read; `load`, `unload_resident` and the weights ops are the only writers.

Threads: `swap` and the weights ops run on the event loop under `swap_lock` (one change at a
time), take the admission slot whole (`limited=False`, so no forward pass sees half a load or
half a write) and do their work in the model executor, which closes its thread's database
connection when done; `load` and `unload_resident` are small sync steps tests call directly.
"""

import asyncio
import gc
import logging
import os
import shutil
import time
from pathlib import Path

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import IntegrityError, close_old_connections, connection, transaction

from inference_app import events, weight_uploads
from inference_app.catalogue import ModelSource, model_not_found, model_not_resident
from inference_app.engine import weights
from inference_app.engine.loader import load_model
from inference_app.engine.runtime import ResidentModel
from inference_app.engine.serving import send_to, weights_torn
from millm_lib.errors import ApiError, internal_error
from inference_app.leases import check_lease_allows
from inference_app.models import Engine, Lease, ModelEntry, Probe
from inference_app.shapes import SavedCheckpoint, WeightsState

log = logging.getLogger("millm.engine")

WEIGHT_ACTIONS = {
    "begin": "editing its weights",
    "write": "writing its weights",
    "commit": "committing its weights",
    "save": "saving its weights",
}


class Residency:
    """The resident model (`runtime`), its weights' state (`weights_torn`), the model being
    loaded (`loading_model_id`, for the heartbeat) and the lock one swap or weights op holds."""

    def __init__(self, worker):
        self.worker = worker
        self.runtime = None
        self.weights_torn = False  # mirrors the resident entry's weights_state (SPEC 5, "Weights")
        self.loading_model_id = None
        self.swapping = False  # a load, unload or swap is under way (no batch row starts)
        self.swap_lock = None

    # --- loading and unloading (sync) ---

    def load(self, model_id=None, startup=False):
        """Make `model_id` (default: the engine's own model) the resident model.

        1. Unload the resident model, if any (its leases end).
        2. Mark the entry loading, load through the production loader (a checkpoint: its base
           model, then its tensors over it), mark it resident.
        3. Weights: a load makes them clean, except the start-up load, which keeps a torn state
           an engine killed mid-edit left (only a load or a late commit ends it).
        """
        engine_id = self.worker.engine_id
        entry, source = self._entry_and_source(model_id)
        self.unload_resident("the model was swapped out")
        entry.mark_loading()
        Engine.objects.set_loading(engine_id, entry.pk)
        close_old_connections()
        try:
            loaded = load_model(source)
            if entry.kind == ModelEntry.Kind.CHECKPOINT:
                weights.apply_checkpoint(loaded.model, entry.source)
                loaded.revision = entry.revision
        except Exception as error:
            entry.mark_load_failed(error)
            Engine.objects.set_loading(engine_id, None)
            raise
        close_old_connections()
        runtime = self.runtime = ResidentModel(loaded, model_id=entry.pk)
        torn = startup and entry.weights_state == ModelEntry.Weights.TORN
        self.weights_torn = torn
        if torn:
            log.warning("the weights of %s were left torn (an edit began and never committed): "
                        "no request or batch row runs until a load or a commit", entry.pk)
        entry.mark_resident(
            torn, revision=loaded.revision, dtype=runtime.dtype_name, context_length=runtime.context_length,
            hidden_size=runtime.hidden_size, num_layers=runtime.num_layers,
        )
        Engine.objects.mark_resident(engine_id, entry.pk, torn)
        self.worker.presence.role = Engine.Role.ACTIVE
        return runtime

    def _entry_and_source(self, model_id):
        source = self.worker.source
        if model_id is None or model_id == source.model_id:
            return ModelEntry.objects.record_engine_model(source), source
        entry = ModelEntry.objects.get(pk=model_id)
        weights_of = entry.root  # a checkpoint loads its base model first
        return entry, ModelSource(Path(weights_of.source), weights_of.source_format, entry.pk, weights_of.quantization,
                                  entry.chat_template or weights_of.chat_template)

    def unload_resident(self, reason, collect=True):
        """Drop the resident model: its leases end and its entry is available again.
        `collect`: free its memory now, for the next model (a full collection: 0.1-0.3 s); an
        engine that is stopping leaves that to the end of its process."""
        if self.runtime is None:
            return
        engine_id = self.worker.engine_id
        model_id = self.runtime.model_id
        self.runtime = None
        if collect:
            gc.collect()
            if torch_cuda_available():
                import torch

                torch.cuda.empty_cache()
        Lease.objects.end_unless_served(reason, model_id, engine_id)
        Engine.objects.set_resident(engine_id, None)
        ModelEntry.objects.release_unless_served(model_id, engine_id)

    def probes_for(self, request, project=None):
        """The probe specs a probe-score request of `project` scores (its own probes: another
        project's id is unknown), checked against the resident model."""
        model_id = self.runtime.model_id
        owned = Probe.objects.owned_by(project)
        if request.probe_ids:
            found = {probe.pk: probe for probe in owned.filter(pk__in=request.probe_ids)}
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
            probes = list(owned.filter(model_id=model_id).order_by("created_at")[: settings.PROBE_SCORE_MAX_PROBES])
            if not probes:
                raise ApiError(
                    400,
                    "invalid_probe_score_request",
                    f"The resident model '{model_id}' has no probes; import one with POST /api/probes",
                    details={"field": "probe_ids"},
                )
        return [probe.spec() for probe in probes]

    # --- swaps (on the event loop) ---

    async def swap(self, model_id, startup=False):
        """Load `model_id` (None: unload) once the slot is free; requests queue behind it. From its
        start to its end the engine is `swapping`: no batch row of either model starts, and their
        waiting batches say `model_not_resident` (the companions are told at once)."""
        engine_id = self.worker.engine_id
        async with self.swap_lock:
            current = self.runtime.model_id if self.runtime else None
            if current == model_id:
                return
            self.loading_model_id, self.swapping = model_id, True
            try:
                await self._announce_swap(Engine.objects.begin_swap, engine_id, model_id)
                seconds = await self._swap_under_the_slot(model_id, startup)
            finally:
                self.loading_model_id, self.swapping = None, False
                await self._announce_swap(Engine.objects.end_swap, engine_id)
                self.worker.wake()  # the batches of the model now resident may run
            if current:
                await self._model_event("model:unload:complete", current)
            if model_id:
                await self._model_event("model:load:complete", model_id, seconds=seconds)
            log.info("engine %s: %s in %.1f s", engine_id,
                     f"loaded {model_id}" if model_id else f"unloaded {current}", seconds)

    async def _announce_swap(self, write, *args):
        """The engine row's `swapping` written (the heartbeat writes it again if this fails) and,
        at the start, the companions told; best effort: a database blip never aborts a load."""
        try:
            await sync_to_async(write)(*args)
            if self.swapping:
                await self.worker.swap_begins()
        except Exception:
            log.warning("could not announce the swap's %s; the next heartbeat does",
                        "start" if self.swapping else "end", exc_info=True)

    async def _swap_under_the_slot(self, model_id, startup):
        """The load or unload itself, holding the whole slot; returns its seconds."""
        slot = self.worker.slot
        if model_id:
            await self._model_event("model:load:progress", model_id, stage="waiting for the slot")
        await slot.acquire(interactive=True, limited=False)
        started = time.monotonic()
        try:
            if model_id:
                await self._model_event("model:load:progress", model_id, stage="loading weights")
            await asyncio.get_running_loop().run_in_executor(
                self.worker.seating.model_thread, self._swap_in_thread, model_id, startup
            )
        except Exception as error:
            await self._model_event("model:load:error", model_id, error=str(error)[:500])
            raise
        finally:
            slot.release(True, None)
        return round(time.monotonic() - started, 2)

    async def _model_event(self, event, model_id, **fields):
        data = {"model_id": model_id, "engine": self.worker.engine_id, **fields}
        await events.apublish(event, data, [events.MODELS_GROUP], rooms=["models"])

    def _swap_in_thread(self, model_id, startup=False):
        try:
            if model_id is None:
                self.unload_resident("the model was unloaded")
            else:
                self.load(model_id, startup=startup)
        finally:
            connection.close()  # this thread's connection; the DB thread keeps its own

    def refuse_if_replicated(self, action):
        """409 model_replicated while another replica of our model runs (SPEC 10c): a load, an
        unload or a weights edit would change this replica and not the others, and the model's
        requests and batch rows would be answered by two sets of weights."""
        model_id = self.worker.source.model_id
        others = Engine.objects.replicas(model_id).exclude(pk=self.worker.engine_id).count()
        if others:
            raise ApiError(
                409, "model_replicated",
                f"The model '{model_id}' runs on {others + 1} replicas (ENGINE_MAX_REPLICAS="
                f"{settings.ENGINE_MAX_REPLICAS}); {action} is refused while more than one replica is active, "
                f"as it would change one replica and not the others. Stop the other replicas first",
                details={"field": "model", "replicas": others + 1},
            )

    async def control(self, message):
        """A load or unload from the management routes: checked, acknowledged, then run."""
        layer = get_channel_layer()
        target = message.get("model_id") if message["type"] == "load" else None
        try:
            current = self.runtime.model_id if self.runtime else None
            if target is not None and not await sync_to_async(ModelEntry.objects.filter(pk=target).exists)():
                raise model_not_found(target, f"The model '{target}' is not in the catalogue")
            if target != current:
                action = "loading another model" if target else "unloading it"
                await sync_to_async(self.refuse_if_replicated)(action)
                await sync_to_async(check_lease_allows)(current, message.get("lease"), action, message.get("project"))
        except ApiError as error:
            await send_to(layer, message["reply"], {"type": "error", "error": error.to_wire()})
            return
        acknowledged = {"type": "result", "body": {"engine": self.worker.engine_id}, "headers": {}}
        await send_to(layer, message["reply"], acknowledged)
        try:
            await self.swap(target)
        except Exception:
            log.exception("%s of %s failed", message["type"], target or current)

    # --- weights ---

    async def edit_weights(self, message):
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
                await sync_to_async(self.refuse_if_replicated)(WEIGHT_ACTIONS[op])
                await sync_to_async(check_lease_allows)(model_id, message.get("lease"), WEIGHT_ACTIONS[op],
                                                         message.get("project"))
                async with self.worker.slot.hold(interactive=True, limited=False):
                    body = await asyncio.get_running_loop().run_in_executor(
                        self.worker.seating.model_thread, self._weights_in_thread, op, message
                    )
        except ApiError as error:
            await send_to(layer, message["reply"], {"type": "error", "error": error.to_wire()})
            return
        except Exception:
            log.exception("weights %s on %s failed", op, model_id)
            await send_to(layer, message["reply"], {"type": "error", "error": internal_error().to_wire()})
            return
        await send_to(layer, message["reply"], {"type": "result", "body": body, "headers": {}})
        if op == "save":
            await self._model_event("model:save:complete", body["model"], renamed_from=model_id)
        if op in ("commit", "save"):
            self.worker.wake()

    def _weights_in_thread(self, op, message):
        try:
            runtime = self.runtime
            if op == "begin":
                self._set_weights_state(runtime.model_id, torn=True)
                return WeightsState(model=runtime.model_id, weights=ModelEntry.Weights.TORN)
            if op == "commit":
                self._set_weights_state(runtime.model_id, torn=False)
                return WeightsState(model=runtime.model_id, weights=ModelEntry.Weights.CLEAN)
            if op == "write":
                if not self.weights_torn:
                    raise ApiError(
                        409, "weights_not_begun",
                        f"Begin the edit first: POST /api/models/{runtime.model_id}/weights/begin, then PUT, then commit",
                    )
                tensors = weights.read_tensors(weight_uploads.read(message["upload"]))
                written = weights.write(runtime.model, tensors)
                runtime.weights_changed()
                log.info("wrote %d tensor(s) of %s", len(written), runtime.model_id)
                return WeightsState(model=runtime.model_id, weights=ModelEntry.Weights.TORN, written=written)
            if self.weights_torn:
                raise weights_torn(runtime.model_id)
            return save_checkpoint(runtime, self.worker.engine_id)
        finally:
            connection.close()  # this thread's connection; the DB thread keeps its own

    def _set_weights_state(self, model_id, torn):
        state = ModelEntry.Weights.TORN if torn else ModelEntry.Weights.CLEAN
        ModelEntry.objects.set_weights(model_id, state)
        Engine.objects.set_weights(self.worker.engine_id, state)
        self.weights_torn = torn
        log.info("the weights of %s are %s", model_id, state)


def save_checkpoint(runtime, engine_id):
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
    Lease.objects.follow_rename(previous.pk, checkpoint.pk)
    Engine.objects.set_resident(engine_id, checkpoint.pk)
    ModelEntry.objects.release_unless_served(previous.pk, engine_id)
    log.info("saved the weights of %s as %s (%s)", previous.pk, checkpoint.pk, path)
    return SavedCheckpoint(model=checkpoint.pk, base=checkpoint.base_id, renamed_from=previous.pk,
                           revision=revision, path=str(path))


def torch_cuda_available():
    import torch

    return torch.cuda.is_available()
