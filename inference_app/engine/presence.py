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
from datetime import timedelta

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from inference_app.models import Engine, Lease, ModelEntry
from millm_lib.db import conninfo

log = logging.getLogger("millm.engine")

STALE_ROW_RETENTION = timedelta(days=1)


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
        Engine.objects.filter(heartbeat_at__lt=timezone.now() - STALE_ROW_RETENTION).delete()
        return Engine.objects.create(
            id=worker.engine_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            channel=worker.channel,
            model_id=worker.source.model_id,
            role=Engine.Role.STANDBY,
            queue_max_concurrent=worker.slot.slots,
            queue_max_pending=worker.slot.max_pending,
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
        model_id, engine_id = self.worker.source.model_id, self.worker.engine_id
        # A restart ends every lease: they are deleted, so a renew answers 404 lease_not_found.
        live = list(Engine.objects.live().values_list("pk", flat=True))
        Lease.objects.filter(model_id=model_id).delete()
        Lease.objects.exclude(engine_id__in=live).delete()
        serving = Engine.objects.live().exclude(resident_model_id=None).values_list("resident_model_id", flat=True)
        ModelEntry.objects.filter(state__in=["resident", "loading", "unloading"]).exclude(id__in=list(serving)).update(
            state=ModelEntry.State.AVAILABLE
        )
        # We hold the model's lock, so another row active for this model is a dead process (or one
        # that lost the lock and is stopping): it serves nothing from now on, whatever its last
        # heartbeat says, and requests are not routed to it while it goes stale.
        Engine.objects.filter(model_id=model_id, role=Engine.Role.ACTIVE).exclude(pk=engine_id).update(
            role=Engine.Role.STANDBY, resident_model_id=None, loading_model_id=None
        )
        self.role = Engine.Role.ACTIVE
        Engine.objects.filter(pk=engine_id).update(role=Engine.Role.ACTIVE, heartbeat_at=timezone.now())

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
            "estimated_wait_seconds": worker.slot.estimated_wait_seconds(),
        }
        if not Engine.objects.filter(pk=worker.engine_id).update(**figures):
            # Someone deleted our row (an operator, a test flush): register again.
            self.register()
            Engine.objects.filter(pk=worker.engine_id).update(**figures)

    def unregister(self):
        """Delete our row and close the lock's connection (which frees the lock)."""
        Engine.objects.filter(pk=self.worker.engine_id).delete()
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
