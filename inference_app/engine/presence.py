"""The engine's presence: its `Engine` row (registration, heartbeat figures, removal) and the
model's PostgreSQL advisory lock, which makes one engine per model the active one.

Small sync methods (register, try_become_active, still_active, activate, heartbeat, unregister)
touch the database and return plain values, so tests call them without processes.

Threads: the sync methods run in asgiref's one sync thread (sync_to_async) when the engine
serves; the lock's connection is used only there. The heartbeat loop and the wait for the lock
run on the event loop.
"""

import asyncio
import hashlib
import logging
import os
import socket

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from inference_app.models import Engine, Lease, ModelEntry
from millm_lib.db import conninfo

log = logging.getLogger("millm.engine")


def advisory_key(model_id):
    """A stable signed 64-bit key for the model's PostgreSQL advisory lock."""
    return int.from_bytes(hashlib.sha256(f"millm-engine:{model_id}".encode()).digest()[:8], "big", signed=True)


class Presence:
    """The engine's row and its model's lock; `role` is what the row says we are, `lost_lock`
    whether another engine took the lock from us (the engine then stops)."""

    def __init__(self, worker):
        self.worker = worker
        self.role = Engine.Role.STANDBY
        self.lost_lock = False
        self._lock_connection = None

    def register(self):
        worker = self.worker
        return Engine.objects.register(
            worker.engine_id, socket.gethostname(), os.getpid(), worker.channel, worker.source.model_id,
            max_concurrent=worker.slot.slots, max_pending=worker.slot.max_pending,
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
            log.warning("could not ask PostgreSQL for the lock of %s: %s", self.worker.source.model_id, error)
            return False

    def _take_lock(self):
        """True if the lock is ours; raises psycopg.Error when PostgreSQL cannot be reached."""
        try:
            if self._lock_connection is None:
                self._lock_connection = psycopg.connect(conninfo(), autocommit=True, connect_timeout=5)
            row = self._lock_connection.execute(
                "SELECT pg_try_advisory_lock(%s)", [advisory_key(self.worker.source.model_id)]
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
        model_id = self.worker.source.model_id
        if self.role != Engine.Role.ACTIVE:
            return True
        if self._lock_connection is not None:
            try:
                self._lock_connection.execute("SELECT 1")
                return True
            except psycopg.Error:
                log.warning("the connection holding the lock of %s was lost; taking the lock again", model_id)
                self._drop_lock_connection()
        try:
            held = self._take_lock()
        except psycopg.Error:
            return True  # PostgreSQL is still down: no other engine can take the lock meanwhile
        if held:
            log.info("engine %s holds the lock of %s again", self.worker.engine_id, model_id)
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
        model_id = self.worker.source.model_id
        Lease.objects.forget_on_restart(model_id)
        ModelEntry.objects.release_unserved()
        self.role = Engine.Role.ACTIVE
        Engine.objects.take_over(self.worker.engine_id, model_id)

    def heartbeat(self):
        worker = self.worker
        close_old_connections()
        runtime = worker.runtime
        figures = {
            "heartbeat_at": timezone.now(),
            "role": self.role,
            "resident_model_id": runtime.model_id if runtime else None,
            "loading_model_id": worker.residency.loading_model_id,
            "weights_state": Engine.Weights.TORN if runtime and worker.weights_torn else Engine.Weights.CLEAN,
            "queue_waiting": worker.slot.waiting,
            "in_flight": worker.slot.holding,
            "sequences_running": len(worker.seating.scheduler.live),
            "queue_waits_total": worker.slot.waits,
            "queue_wait_seconds_total": worker.slot.wait_seconds,
            "estimated_wait_seconds": worker.slot.estimated_wait_seconds(),
        }
        if not Engine.objects.report_heartbeat(worker.engine_id, **figures):
            self.register()
            Engine.objects.report_heartbeat(worker.engine_id, **figures)

    def unregister(self):
        """Delete our row and close the lock's connection (which frees the lock)."""
        Engine.objects.unregister(self.worker.engine_id)
        if self._lock_connection is not None:
            self._lock_connection.close()
            self._lock_connection = None

    async def heartbeat_loop(self):
        worker = self.worker
        while True:
            try:
                if not await sync_to_async(self.still_active)():
                    # A standby holds the lock and is the active engine now (SPEC 5: one active
                    # engine per model): stop, with a status a supervisor restarts (as a standby).
                    log.error("engine %s lost the lock of %s to another engine; stopping", worker.engine_id,
                              worker.source.model_id)
                    self.role = Engine.Role.STANDBY
                    self.lost_lock = True
                    worker.stopping.set()
                await sync_to_async(self.heartbeat)()
            except Exception:
                log.exception("heartbeat failed; retrying")
            await asyncio.sleep(settings.ENGINE_HEARTBEAT_S)

    async def wait_for_lock(self):
        worker = self.worker
        announced = False
        while not worker.stopping.is_set():
            if await sync_to_async(self.try_become_active)():
                return True
            if not announced:
                log.info("engine %s is a standby: another engine holds %s", worker.engine_id, worker.source.model_id)
                announced = True
            await worker.nap(settings.ENGINE_HEARTBEAT_S)
        return False
