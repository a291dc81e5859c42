"""The engine's Worker: the coordinator of the engine's rooms, and the loop `runbatchworker` runs.

- `presence.Presence`: the engine's row, the model's advisory lock, the heartbeat;
- `residency.Residency`: the resident model (`runtime`), its weights (`weights_torn`), swaps
  and weights ops;
- `serving.Serving`: the interactive consumer that answers what web processes forward over the
  Channels layer.

Small sync methods (register, try_become_active, load, heartbeat, unregister) touch the
database and return plain values, so tests call them on the Worker without processes; `serve()`
is the asyncio loop. Companions (the batch runner) use only the Worker's face: `engine_id`,
`source`, `seat`, `runtime`, `weights_torn`, `swapping`, `seating`, `stopping`, `nap()`,
`wake()`, `probes_for()`, and they report in `batch_work`; one with an async `swap_begins()` is
told when a load, unload or swap begins.

Threads: the event loop receives messages and schedules; database work runs in asgiref's one
sync thread (sync_to_async); forward passes run in the seating's model thread (the whole
model) or in the step scheduler's decode thread (seated generation).
"""

import asyncio
import contextlib
import logging
import os
import signal

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from inference_app.engine.seating import Seating
from inference_app.engine.presence import Presence
from inference_app.engine.residency import Residency
from inference_app.engine.serving import SHUTDOWN_GRACE_S, Serving
from millm_lib.ids import new_id

log = logging.getLogger("millm.engine")

LOST_LOCK_EXIT = 3  # the exit status of an engine whose model's lock another engine took


class Worker:
    def __init__(self, source, jobs=(), companions=()):
        """`jobs`: (name, interval in seconds, sync callable) run at start-up and then on that
        interval, in the database thread (file retention is one).
        `companions`: factories called with this worker, giving objects with a sync
        `reconcile()` (run once the engine is active and its model loaded) and an async `run()`
        (the batch runner is one). inference_app never imports them."""
        self.source = source
        self.jobs = list(jobs)
        self.engine_id = new_id("eng_")
        self.channel = f"{settings.CHANNEL_PREFIX}.engine.{self.engine_id}"
        self.stopping = None
        self.presence = Presence(self)
        self.residency = Residency(self)
        self.seating = Seating(self.residency)
        self.slot = self.seating.slot
        self.serving = Serving(self)
        # What the batch runner is doing, for the heartbeat: {batch, role, rows_run} or None.
        self.batch_work = None
        self.companions = [factory(self) for factory in companions]

    # --- the rooms' state and steps, as the runner and tests see them ---

    @property
    def runtime(self):
        return self.residency.runtime

    @property
    def seat(self):
        """Our model's replica seat (0 until we hold one, as with one replica)."""
        return self.presence.seat or 0

    @property
    def weights_torn(self):
        return self.residency.weights_torn

    @property
    def swapping(self):
        return self.residency.swapping

    async def swap_begins(self):
        for companion in self.companions:
            if hasattr(companion, "swap_begins"):
                await companion.swap_begins()

    def register(self):
        return self.presence.register()

    def try_become_active(self):
        return self.presence.try_become_active()

    def still_active(self):
        return self.presence.still_active()

    def activate(self):
        self.presence.activate()

    def heartbeat(self):
        self.presence.heartbeat()

    def load(self, model_id=None, startup=False):
        return self.residency.load(model_id, startup=startup)

    def probes_for(self, request, project=None):
        return self.residency.probes_for(request, project)

    def unregister(self):
        close_old_connections()
        self.residency.unload_resident("the engine stopped", collect=False)  # the process ends next
        self.presence.unregister()

    # --- the loop ---

    def run(self):
        """Serve until stopped; the process's exit status: 0, or LOST_LOCK_EXIT."""
        asyncio.run(self.serve())
        return LOST_LOCK_EXIT if self.presence.lost_lock else 0

    async def serve(self):
        """1. Register as a standby and start the heartbeat.
        2. Wait for the model's advisory lock (another engine may hold it), then load.
        3. Answer forwarded requests until SIGTERM; then finish what is in flight and leave."""
        self.stopping = asyncio.Event()
        self.nappers = set()
        self.residency.swap_lock = asyncio.Lock()
        self._install_signal_handlers()
        await sync_to_async(self.register)()
        heartbeat = asyncio.create_task(self.presence.heartbeat_loop())
        jobs = [asyncio.create_task(self._job_loop(*job)) for job in self.jobs]
        try:
            if not await self.presence.wait_for_lock():
                return
            log.info("engine %s is active for %s; loading", self.engine_id, self.source.model_id)
            await sync_to_async(self.activate)()
            await self.residency.swap(self.source.model_id, startup=True)
            log.info("engine %s serving %s on %s", self.engine_id, self.runtime.model_id, self.channel)
            for companion in self.companions:
                await sync_to_async(companion.reconcile)()
            running = [asyncio.create_task(companion.run()) for companion in self.companions]
            await self.serving.consume()
            await self.serving.drain()
            if running:
                await asyncio.wait(running, timeout=SHUTDOWN_GRACE_S)
        finally:
            heartbeat.cancel()
            for job in jobs:
                job.cancel()
            await sync_to_async(self.unregister)()
            self.seating.shutdown()
            log.info("engine %s stopped", self.engine_id)

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

    def wake(self):
        for woken in self.nappers:
            woken.set()

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
