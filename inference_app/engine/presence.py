"""The engine's presence: its `Engine` row (registration, heartbeat figures, removal) and its
model's PostgreSQL advisory locks, one per replica seat (`ENGINE_MAX_REPLICAS`, SPEC 10c): the
engine holding a seat is active, the others are standbys that take the first seat a dead
replica frees.

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

from inference_app.engine import prefix_cache
from inference_app.models import Engine, Lease, ModelEntry
from millm_lib.db import conninfo

log = logging.getLogger("millm.engine")


def advisory_key(model_id, seat=0):
    """A stable signed 64-bit key for the advisory lock of the model's `seat`; seat 0's is the
    key of the one lock there was before replicas."""
    name = f"millm-engine:{model_id}" if seat == 0 else f"millm-engine:{model_id}:seat-{seat}"
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


# The advisory locks held in this database, as (classid << 32 | objid): PostgreSQL splits a
# bigint key into its high and low 32 bits.
HELD_KEYS = (
    "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND objsubid = 1 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def unsigned(key):
    return key & 0xFFFF_FFFF_FFFF_FFFF


class Presence:
    """The engine's row and its model's lock; `role` is what the row says we are, `lost_lock`
    whether another engine took the lock from us (the engine then stops)."""

    def __init__(self, worker):
        self.worker = worker
        self.role = Engine.Role.STANDBY
        self.lost_lock = False
        self.seat = None  # the seat whose lock we hold, once active
        self._lock_connection = None

    def register(self):
        worker = self.worker
        return Engine.objects.register(
            worker.engine_id, socket.gethostname(), os.getpid(), worker.channel, worker.source.model_id,
            max_concurrent=worker.slot.slots, max_pending=worker.slot.max_pending,
        )

    def try_become_active(self):
        """Take a seat of the model: the first of its ENGINE_MAX_REPLICAS advisory locks that is
        free, on a connection held for the engine's lifetime.

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
        """True if a seat is ours (our own first, if we had one); raises psycopg.Error when
        PostgreSQL cannot be reached."""
        seats = list(range(settings.ENGINE_MAX_REPLICAS))
        if self.seat in seats:
            seats.remove(self.seat)
            seats.insert(0, self.seat)
        try:
            if self._lock_connection is None:
                self._lock_connection = psycopg.connect(conninfo(), autocommit=True, connect_timeout=5)
            for seat in seats:
                row = self._lock_connection.execute(
                    "SELECT pg_try_advisory_lock(%s)", [advisory_key(self.worker.source.model_id, seat)]
                ).fetchone()
                if row[0]:
                    self.seat = seat
                    return True
            return False
        except psycopg.Error:
            self._drop_lock_connection()
            raise

    def notice_dead_replicas(self):
        """Demote the active rows of our model whose seat nobody holds (their process died):
        web stops routing to them at once and the batch runner's sweep frees their claims."""
        if self._lock_connection is None or settings.ENGINE_MAX_REPLICAS == 1:
            return []  # with one seat, the standby that takes it demotes the dead row (take_over)
        model_id = self.worker.source.model_id
        # The rows first, then the locks: a replica that takes its seat and activates between the
        # two reads is not in the rows read, and so is never taken for dead.
        seated = Engine.objects.seated_peers(model_id, self.worker.engine_id)
        if not seated:
            return []
        try:
            held = {unsigned(row[0]) for row in self._lock_connection.execute(HELD_KEYS).fetchall()}
        except psycopg.Error:
            return []  # PostgreSQL is away: the next heartbeat's still_active connects again
        dead = [engine_id for engine_id, seat in seated if unsigned(advisory_key(model_id, seat)) not in held]
        Engine.objects.demote(Engine.objects.filter(pk__in=dead))
        for engine_id in dead:
            log.warning("replica %s of %s lost its seat (its process is gone): its work is freed", engine_id,
                        self.worker.source.model_id)
        return dead

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
            log.info("engine %s holds the lock of %s again (seat %d)", self.worker.engine_id, model_id, self.seat)
            Engine.objects.take_over(self.worker.engine_id, model_id, self.seat)
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
        Engine.objects.take_over(self.worker.engine_id, model_id, self.seat)
        self.notice_dead_replicas()  # a replica killed with us looks live for ENGINE_STALE_S
        Lease.objects.forget_on_restart(model_id, self.worker.engine_id)
        ModelEntry.objects.release_unserved()
        self.role = Engine.Role.ACTIVE

    def heartbeat(self):
        worker = self.worker
        close_old_connections()
        runtime = worker.runtime
        figures = {
            "heartbeat_at": timezone.now(),
            "role": self.role,
            "resident_model_id": runtime.model_id if runtime else None,
            "loading_model_id": worker.residency.loading_model_id,
            "swapping": worker.residency.swapping,  # repairs a reset that failed at a swap's end
            "weights_state": Engine.Weights.TORN if runtime and worker.weights_torn else Engine.Weights.CLEAN,
            "queue_waiting": worker.slot.waiting,
            "in_flight": worker.slot.holding,
            "sequences_running": len(worker.seating.scheduler.live),
            "queue_waits_total": worker.slot.waits,
            "queue_wait_seconds_total": worker.slot.wait_seconds,
            "prefix_tokens_reused_total": prefix_cache.tokens_reused_total(),
            "prefix_cache_bytes": runtime.prefix_cache.nbytes if runtime else 0,
            "estimated_wait_seconds": worker.slot.estimated_wait_seconds(),
            "batch_work": worker.batch_work,
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
                if self.role == Engine.Role.ACTIVE:
                    await sync_to_async(self.notice_dead_replicas)()
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
