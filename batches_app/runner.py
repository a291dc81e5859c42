"""The batch runner, inside the engine process (`runbatchworker`).

Two loops share the engine's event loop:
- validation: claims `validating` batches and validates each in a thread of its own, outside
  the admission slot;
- running: takes the oldest runnable batch of the resident model and runs it chunk by chunk,
  each chunk under the slot as a background holder (interactive requests go first at every
  chunk boundary, and a chunk of single rows ends at the next row once one waits), each chunk's
  rows claimed under a token of its own and recorded in one transaction fenced by it.

Replicas (SPEC 10c): the engine that claims the batch is its *leader*: the checks before each
chunk, the waiting reasons, finalization and assembly are its alone. Another replica of the
batch's model finding no older batch to lead *helps*: it claims chunks of the same batch and
records them while the batch runs and no end was asked for (`Batch.record_chunk`).

Rows run through the very service functions the synchronous routes call.
"""

import asyncio
import logging
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections, connection, transaction

from batches_app import assembly, events, leasing, validation
from batches_app.models import Batch, BatchRow, FencedOut, RowResult
from inference_app.engine import packing, policy, services
from inference_app.engine.seating import NOT_RUN
from millm_lib.errors import ApiError, internal_error
from millm_lib.ids import new_id
from inference_app.models import Engine
from inference_app.schemas import parse_request
from millm_lib.limits import GENERATION_ENDPOINTS, PACKABLE_ENDPOINTS, PROBE_SCORE
from projects_app.models import Project

log = logging.getLogger("millm.batches")
# One line per chunk executed: its batch, the engine, the lines that produced a result and the
# moment they had (epoch seconds), logged before any record: a line executed after its
# recorded_at ran again (MILLM_LOG_EXECUTIONS; the tests count executions with it).
executions = logging.getLogger("millm.batches.executions")

PROGRESS_LOG_S = 5.0
HELPERS_POLL_S = 0.1  # a leader waiting for its helpers' last chunks looks this often


def reconcile_batches(engine_id, model_id, seat=0):
    """Start-up reconciliation (see `release_claims_of_dead_engines`)."""
    released = Batch.objects.release_claims_of_dead_engines(engine_id, model_id, seat)
    if released:
        log.info("reconciled %d unfinished batch(es) left by a stopped engine", released)
    return released


@dataclass(frozen=True, slots=True)
class PendingRow:
    """A row about to run, its body parsed once: its kind, its length, its probes and its run
    all read `parsed`, the request or the ApiError the route would refuse it with."""

    row: BatchRow
    parsed: object

    @classmethod
    def of(cls, endpoint, row):
        try:
            return cls(row, parse_request(endpoint, row.body, strict=True))
        except ApiError as error:
            return cls(row, error)

    @property
    def refused(self):
        return isinstance(self.parsed, ApiError)

    @property
    def generates(self):
        """A chat or completion row that generates (not scoring), as the service functions
        decide (`logprobs: 0` is scoring in completions, not in chat): it runs alone, or seated.
        A refused row does not: it fails in a chunk of its own, as the route would refuse it."""
        return not self.refused and services.is_generation(self.parsed)


class BatchRunner:
    def __init__(self, worker):
        self.worker = worker
        self.chunks = 0
        # Rows seen but not yet run, for the batch in hand: a row waiting in the packing window,
        # or the scoring row that ended a run of seated ones, is parsed (and measured) once.
        self.parsed = {}  # row id -> PendingRow
        self.lengths = {}  # row id -> token length, for length-aware packing
        self.throttle = events.Throttle()
        self.seated = {}  # row id -> the task running it in a seat (batched decoding)
        self.progress_log = {}  # batch id -> (started, rows done then, last logged)
        # Claims we could not release (the database was down): released at the next sweep, or
        # this live engine would hold them forever and the batch would never run again.
        self.unreleased = {}
        self.rows_run = 0  # rows this engine recorded in the batch in hand (health's batch_work)

    # --- entry points the Worker calls ---

    def reconcile(self):
        return reconcile_batches(self.worker.engine_id, self.worker.source.model_id, self.worker.seat)

    async def run(self):
        await asyncio.gather(self._validation_loop(), self._run_loop())

    # --- validation ---

    async def _validation_loop(self):
        while not self.worker.stopping.is_set():
            try:
                batch = await sync_to_async(self._claim_to_validate, thread_sensitive=True)()
                if batch is None:
                    await self.worker.nap(settings.BATCH_WAIT_POLL_S)
                    continue
                resident = self.worker.runtime.model_id if self.worker.runtime else None
                await asyncio.to_thread(self._validate_in_thread, batch, resident)
                self.worker.wake()  # its rows may run now: the run loop need not finish its nap
                await self._wake_replicas(batch)
            except Exception:
                log.exception("validation failed; retrying")
                await self.worker.nap(settings.BATCH_WAIT_POLL_S)

    async def _wake_replicas(self, batch):
        """The other running engines with the batch's model resident look at it now, not at their
        next poll (BATCH_WAIT_POLL_S): each replica helps from its first chunk (SPEC 10c)."""
        channels = await sync_to_async(self._replica_channels)(batch)
        layer = get_channel_layer()
        for channel in channels:
            try:
                await layer.send(channel, {"type": "wake"})
            except Exception:
                log.debug("could not wake %s; it polls anyway", channel, exc_info=True)

    def _replica_channels(self, batch):
        model = Batch.objects.filter(pk=batch.pk, status=Batch.Status.IN_PROGRESS).values_list("model", flat=True).first()
        if model is None:
            return []
        return list(Engine.objects.running().filter(resident_model_id=model).exclude(pk=self.worker.engine_id)
                    .values_list("channel", flat=True))

    def _validate_in_thread(self, batch, resident):
        try:
            token = batch.claim_token
            outcome = validation.validate(batch, resident)
            if outcome == Batch.Status.IN_PROGRESS:
                events.publish(batch)  # the move to in_progress released our claim
                return
            batch.refresh_from_db()
            if batch.claim_token != token:
                raise FencedOut(batch.pk)
            if outcome == Batch.Status.FAILED or batch.status == Batch.Status.CANCELLING:
                assembly.assemble(batch)
            else:
                batch.release_claim()
            events.publish(batch)
        except FencedOut:
            log.warning("batch %s was taken over during validation", batch.pk)
        except Exception:
            log.exception("validating %s failed; it will be validated again", batch.pk)
            self._release_or_remember(batch)
        finally:
            connection.close()

    # --- running ---

    async def _run_loop(self):
        while not self.worker.stopping.is_set():
            batch = leading = None
            try:
                await sync_to_async(self._sweep)()
                batch, leading, verdict = await sync_to_async(self._claim_to_run)()
                if batch is None or await self._process(batch, leading, verdict) == "waiting":
                    await self.worker.nap(settings.BATCH_WAIT_POLL_S)
            except FencedOut as fenced:
                log.warning("fenced out of %s: another engine claimed it, or it is ending", fenced)
                await self._abandon_seated()
                if leading:  # a no-op when the claim is another engine's now; never left held
                    await sync_to_async(self._release_or_remember)(batch)
            except Exception:
                log.exception("the batch runner failed; the batch is released and retried")
                await self._abandon_seated()
                if batch is not None and leading:
                    await sync_to_async(self._release_or_remember)(batch)
                await self.worker.nap(settings.BATCH_WAIT_POLL_S)
            finally:
                if batch is not None:
                    await sync_to_async(self._let_go_of_rows)(batch)

    def _claim_to_validate(self):
        """The oldest batch to validate, claimed with a fresh fencing token; or None."""
        close_old_connections()
        return Batch.objects.to_validate().claim_oldest(self.worker.engine_id)

    def _claim_to_run(self):
        """(batch, leading, verdict): the oldest batch to end, or to run on the resident model. One
        that no engine holds is claimed with a fresh fencing token and led, unless a batch as old
        or older is led by another replica: then that one is helped while it has rows nobody runs
        (every replica works on the oldest batch first). (None, None, None) when there is nothing.

        A batch to run is checked in the claim's transaction (`verdict`, as `_before_chunk`'s): it
        is seen unclaimed with the reason it waits for, or claimed to run with none, never
        between (SPEC 10, "Waiting")."""
        close_old_connections()
        engine_id = self.worker.engine_id
        runtime = self.worker.runtime
        model_id = runtime.model_id if runtime else None
        helpable = led = None
        if model_id:
            helpable = Batch.objects.to_help(model_id, engine_id).first()
            led = Batch.objects.led_elsewhere(model_id, engine_id).first()
        # A batch led elsewhere comes first: a newer one led here would want the model's lease
        # too, which the older one holds (one live lease per model).
        with transaction.atomic():
            batch = Batch.objects.to_run(model_id).claim_oldest(engine_id, running_before=led.created_at if led else None)
            if batch is not None:
                runs_rows = batch.status == Batch.Status.IN_PROGRESS and not batch.end_status
                return batch, True, self._check_leading(batch) if runs_rows else None
        return (helpable, False, None) if helpable is not None else (None, None, None)

    def _let_go_of_rows(self, batch):
        """Done with `batch` for now: our claims on its rows not recorded end, so any replica runs
        them (best effort: the sweep frees them once we stop running anyway)."""
        try:
            close_old_connections()
            BatchRow.objects.filter(batch=batch).release_claims(self.worker.engine_id)
        except Exception:
            log.warning("could not release our row claims on %s", batch.pk, exc_info=True)
        self.worker.batch_work = None

    def _release_or_remember(self, batch):
        try:
            close_old_connections()
            batch.release_claim()
        except Exception:
            log.warning("could not release the claim on %s (is the database down?); retrying at the next sweep",
                        batch.pk, exc_info=True)
            self.unreleased[batch.pk] = batch

    def _release_remembered(self):
        for batch_id, batch in list(self.unreleased.items()):
            batch.release_claim()  # raises while the database is still down: the sweep fails, retried
            self.unreleased.pop(batch_id, None)
            log.info("released the claim on %s", batch_id)

    async def _process(self, batch, leading=True, verdict=None):
        """Run one batch, as its leader (claimed) or a helper, until it ends or must wait (or,
        helping, has no rows left that nobody runs); "waiting" when it must wait. `verdict`: the
        check its claim made already, for the first chunk."""
        if batch.status != Batch.Status.IN_PROGRESS or batch.end_status:
            await self._assemble(batch)
            return "ended"
        # Rows parsed for an earlier claim may have been recorded since, or the model changed.
        self.parsed.clear()
        self.lengths.clear()
        self.rows_run = 0
        if verdict in ("wait", "release"):  # let go at its claim: nothing runs, no helper is wanted
            return "waiting" if verdict == "wait" else "released"
        self._report_work(batch, leading)
        if leading:
            await self._wake_replicas(batch)  # it has a leader now: the others may help at once
        swept = time.monotonic()
        while not self.worker.stopping.is_set():
            if time.monotonic() - swept > settings.BATCH_WAIT_POLL_S:
                await sync_to_async(self._sweep)()  # the others' expiry and waiting reasons
                swept = time.monotonic()
            if verdict is None:
                verdict = await sync_to_async(self._before_chunk)(batch, leading)
            if verdict == "assemble":
                await self._abandon_seated()
                await self._assemble(batch)
                return "ended"
            if verdict in ("release", "wait"):  # a leader's claim was released with the reason
                await self._abandon_seated()
                return "waiting" if verdict == "wait" else "released"
            verdict = None
            if self._decodes_batched(batch):
                rows = await sync_to_async(self._next_seated_rows)(batch)
                if rows or self.seated:
                    await self._run_seated(batch, rows, leading)
                    continue
            rows = await sync_to_async(self._next_chunk)(batch)
            if rows:
                await self._run_chunk(batch, rows, leading)
                continue
            left = await sync_to_async(self._rows_left)(batch)
            if left == "claimable":
                continue  # another replica took the rows we chose: choose again
            if not leading:
                return "ended"  # what is left is being run by the others
            if left == "claimed":
                # Helpers are running the last rows: their chunks land soon; then we finalize.
                await self.worker.nap(min(settings.BATCH_WAIT_POLL_S, HELPERS_POLL_S))
                continue
            if await sync_to_async(batch.start_finalizing)():
                await events.apublish(batch)
                await self._assemble(batch)
                return "ended"
            # cancelled meanwhile: the next check sees it
        await self._finish_seated(batch, leading)
        if leading:
            await sync_to_async(batch.release_claim)()
        return "stopped"

    def _rows_left(self, batch):
        """"claimable" (rows nobody runs), "claimed" (rows only other engines run) or "none"."""
        if batch.rows.claimable(self.worker.engine_id).exists():
            return "claimable"
        return "claimed" if batch.rows.unrecorded().exists() else "none"

    def _report_work(self, batch, leading):
        self.worker.batch_work = {"batch": batch.pk, "role": "leader" if leading else "helper", "rows_run": self.rows_run}

    def _before_chunk(self, batch, leading=True):
        """Cancelled? expired? model resident? weights clean? lease held? The leader records the
        waiting reason if not, and lets go of the batch; a helper stops helping."""
        close_old_connections()
        batch.refresh_from_db()
        if not leading:
            return self._before_helping(batch)
        with transaction.atomic():
            return self._check_leading(batch)

    def _check_leading(self, batch):
        """The leader's check, in a transaction: "assemble" (an end was asked for: ended here),
        "run" (the batch shows no waiting reason), or "release"/"wait" with the reason recorded
        and the claim released in the same transaction (announced once it commits)."""
        if batch.claim_token is None or batch.claimed_by != self.worker.engine_id:
            raise FencedOut(batch.pk)
        end = batch.due_end()
        if end is not None:
            batch.mark_ending(end)
            return "assemble"
        runtime = self.worker.runtime
        if runtime is None or runtime.model_id != batch.model:
            verdict, reason = "release", Batch.Waiting.MODEL_NOT_RESIDENT
        elif self.worker.swapping:
            # Being loaded or unloaded (the seed's `model_not_resident` too): wait for the swap's
            # end (it wakes the runner) rather than claim the batch again at once.
            verdict, reason = "wait", Batch.Waiting.MODEL_NOT_RESIDENT
        elif self.worker.weights_torn:
            # An edit is mid-write: no row runs until a commit or a load (SPEC 10, "Waiting").
            verdict, reason = "wait", Batch.Waiting.WEIGHTS_TORN
        elif not leasing.hold(batch, self.worker.engine_id, settings.BATCH_LEASE_TTL_S):
            verdict, reason = "wait", Batch.Waiting.LEASE_UNAVAILABLE
        else:
            verdict, reason = "run", None
        changed = batch.set_waiting(reason)
        if verdict != "run":
            batch.release_claim()
        if changed:
            transaction.on_commit(lambda: events.publish(batch))
        return verdict

    def _before_helping(self, batch):
        """A helper's check before each chunk: the leader still holds the batch ("release" when it
        let go: the batch is ours to lead at the next claim), the batch runs and no end was
        asked for, our resident model is its model with clean weights, and the lease the leader
        runs it under is live ("wait" otherwise: the leader records why)."""
        if batch.claimed_by is None:
            return "release"
        runtime = self.worker.runtime
        if (batch.status != Batch.Status.IN_PROGRESS or batch.end_status or batch.due_end() is not None
                or runtime is None or runtime.model_id != batch.model or self.worker.swapping
                or self.worker.weights_torn or not leasing.is_held(batch)):
            return "wait"
        return "run"

    def _next_chunk(self, batch):
        """The rows the next chunk runs (PendingRows), in one query: probe-score and generation
        rows one at a time; scoring and embedding rows BATCH_CHUNK_ROWS at a time, or packs when
        packing."""
        claimable = batch.rows.claimable(self.worker.engine_id)
        if batch.endpoint == PROBE_SCORE:
            return self._take(batch.endpoint, claimable[:1])
        packed = batch.pack and batch.endpoint in PACKABLE_ENDPOINTS
        size = (batch.pack_window or settings.BATCH_PACK_MAX_ROWS) if packed else settings.BATCH_CHUNK_ROWS
        window = list(claimable[:size])
        if window and batch.endpoint in GENERATION_ENDPOINTS and self._pending(batch.endpoint, window[0]).generates:
            return self._take(batch.endpoint, window[:1])
        if not (packed and batch.pack_window):
            return self._take(batch.endpoint, window)
        # Length-aware: of the next `pack_window` rows, the ones of most similar length go
        # together; each row is still recorded on its own line, so the output stays in order.
        for row in window:
            if row.pk not in self.lengths:
                self.lengths[row.pk] = self._length(self._pending(batch.endpoint, row))
        chunk = packing.choose_pack(window, lambda row: self.lengths[row.pk], settings.BATCH_PACK_MAX_ROWS)
        return self._take(batch.endpoint, chunk)

    def _pending(self, endpoint, row):
        if row.pk not in self.parsed:
            self.parsed[row.pk] = PendingRow.of(endpoint, row)
        return self.parsed[row.pk]

    def _take(self, endpoint, rows):
        """`rows` run now: claimed (those another replica claimed first are left out), parsed
        (once), and out of the memos of rows still waiting."""
        chosen = list(rows)
        rows = BatchRow.objects.claim(chosen, self.worker.engine_id)
        taken = []
        for row in rows:
            # The claimed instance carries the claim's token, which its record is fenced by; a
            # row parsed earlier keeps only its parsed body.
            parsed = self.parsed.get(row.pk)
            taken.append(PendingRow(row, parsed.parsed) if parsed else PendingRow.of(endpoint, row))
        for row in chosen:  # run now, or another replica's: out of the memos either way
            self.parsed.pop(row.pk, None)
            self.lengths.pop(row.pk, None)
        return taken

    def _length(self, pending):
        return 0 if pending.refused else packing.sequence_length(self.worker.runtime, pending.parsed)

    async def _run_chunk(self, batch, rows, leading=True):
        seating = self.worker.seating
        probes = None
        if batch.endpoint == PROBE_SCORE:
            probes = await sync_to_async(self._probes_of)(batch, rows)
        results = await seating.exclusive(
            batch.model, execute_rows, batch.endpoint, rows, probes, batch.pack, seating.give_way
        )
        if results is NOT_RUN:
            results = []  # a swap or a weights edit took the slot first: the next check makes the batch wait
        if results:
            await self._record(batch, results, leading)
        if len(results) < len(rows):  # the chunk gave way to a chat: the rest is anyone's again
            ran = {result.row.pk for result in results}
            await sync_to_async(BatchRow.objects.release_claims)(
                self.worker.engine_id, [pending.row for pending in rows if pending.row.pk not in ran]
            )

    async def _record(self, batch, results, leading=True):
        if settings.BATCH_TEST_PAUSE_BEFORE_RECORD_S:
            await asyncio.sleep(settings.BATCH_TEST_PAUSE_BEFORE_RECORD_S)  # tests kill the engine here
        self.chunks += 1
        await sync_to_async(batch.record_chunk)(results, self.chunks, self.worker.engine_id, leading)
        self.rows_run += len(results)
        self._report_work(batch, leading)
        await self.on_progress(batch)

    # --- batched decoding: generation rows in seats of their own ---

    def _decodes_batched(self, batch):
        return batch.batched_decoding and self.worker.seating.batched and batch.endpoint in GENERATION_ENDPOINTS

    def _next_seated_rows(self, batch):
        """The next generation rows in file order that are not in flight, as many as there are
        seats a batch may take (all but one); stops at a scoring row, which runs in a chunk of
        its own once the rows in flight are done."""
        room = policy.batch_seats(self.worker.seating.seats) - len(self.seated)
        if room <= 0:
            return []
        rows = []
        for row in batch.rows.claimable(self.worker.engine_id).exclude(pk__in=list(self.seated))[:room]:
            if not self._pending(batch.endpoint, row).generates:
                break
            rows.append(row)
        return self._take(batch.endpoint, rows)

    async def _run_seated(self, batch, rows, leading=True):
        """Start `rows` (PendingRows), each in a background seat; wait until one or more of the
        rows in flight is done (or a second passes), and record those in one fenced transaction."""
        seating = self.worker.seating
        for pending in rows:
            self.seated[pending.row.pk] = asyncio.create_task(
                seating.seated(batch.model, execute_rows, batch.endpoint, [pending])
            )
        done, _ = await asyncio.wait(set(self.seated.values()), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        results, not_run = [], []
        for pk, task in list(self.seated.items()):
            if task in done:
                del self.seated[pk]
                outcome = task.result()  # a failure inside is a row's ApiError already; others propagate
                if outcome is NOT_RUN:
                    not_run.append(pk)
                else:
                    results.extend(outcome)
        if results:
            await self._record(batch, results, leading)
        if not_run:
            await sync_to_async(BatchRow.objects.filter(pk__in=not_run).release_claims)(self.worker.engine_id)

    async def _finish_seated(self, batch, leading=True):
        """A stop: the rows in flight finish and are recorded; no new row starts."""
        while self.seated:
            await self._run_seated(batch, [], leading)

    async def _abandon_seated(self):
        """The batch ends or must wait: rows in flight stop at their next step, unrecorded (a
        row that was never recorded runs again from its start)."""
        tasks = list(self.seated.values())
        self.seated.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _probes_of(self, batch, rows):
        """Each probe-score row's probes (read outside the model thread), or its ApiError. A
        batch scores with its own project's probes only; one without a project is the default
        project's (as `owned_by` has it)."""
        project = batch.project or Project.objects.default()
        specs = {}
        for pending in rows:
            if pending.refused:
                specs[pending.row.pk] = pending.parsed
                continue
            try:
                specs[pending.row.pk] = self.worker.probes_for(pending.parsed.request, project)
            except ApiError as error:
                specs[pending.row.pk] = error
        return specs

    async def _assemble(self, batch):
        await asyncio.to_thread(self._assemble_in_thread, batch)
        await self.on_progress(batch)

    def _assemble_in_thread(self, batch):
        try:
            batch.refresh_from_db()
            assembly.assemble(batch)
        finally:
            connection.close()

    async def on_progress(self, batch):
        """`batch:progress` after a recorded chunk (throttled) or an end (always), and for
        operators a log line per running batch at most every PROGRESS_LOG_S."""
        if self.throttle.due(batch):
            await events.apublish(batch)
        self._log_progress(batch)

    def _log_progress(self, batch):
        done = batch.completed + batch.failed
        now = time.monotonic()
        started, done_then, logged = self.progress_log.setdefault(batch.pk, (now, done, 0.0))
        if batch.status != Batch.Status.IN_PROGRESS:
            self.progress_log.pop(batch.pk, None)
            return
        if now - logged < PROGRESS_LOG_S:
            return
        rate = (done - done_then) / max(now - started, 1e-9)
        left = batch.total - done
        eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
        log.info("batch %s: %d/%d rows, %.1f rows/s, ETA %s", batch.pk, done, batch.total, rate, eta)
        self.progress_log[batch.pk] = (started, done_then, now)

    async def swap_begins(self):
        """A load, unload or swap began on this engine (the Worker tells its companions): the
        waiting batches of the models it changes say `model_not_resident` from now, not from the
        next sweep (a running one says it at its next check, once its chunk is done)."""
        for batch in await sync_to_async(Batch.objects.note_why_waiting)():
            await events.apublish(batch)

    def _sweep(self):
        """Between chunks and while idle: dead claims released, queued batches say why they
        wait, unclaimed batches past expires_at end expired."""
        close_old_connections()
        self._release_remembered()
        Batch.objects.release_stale_claims()
        for batch in Batch.objects.note_why_waiting():
            events.publish(batch)
        Batch.objects.expire_waiting()


def execute_rows(runtime, endpoint, rows, probes=None, pack=False, give_way=None):
    """Runs in the model thread: each row (a PendingRow, parsed already) through the synchronous
    route's service function, or, with `pack`, scoring and embedding rows many to a forward pass.
    Returns a RowResult per row run.

    `give_way()` is asked before each single row after the first: when it says yes (a chat is
    waiting), the chunk ends there and only the rows before it are returned, the rest left for the
    next chunk. A chunk with packs runs whole (its packs are already computed)."""
    outcomes = {pending.row.pk: pending.parsed for pending in rows if pending.refused}
    packed = [pending for pending in rows if pack and not pending.refused and services.is_packable(pending.parsed)]
    if packed:
        try:
            for pending, outcome in zip(packed, packing.run_packed(runtime, [pending.parsed for pending in packed])):
                outcomes[pending.row.pk] = outcome
        except Exception:
            log.exception("a pack of %s failed; its rows run one at a time", rows[0].row.batch_id)
            packed = []
    for index, pending in enumerate(rows):
        row = pending.row
        if row.pk in outcomes:
            continue
        if index and not packed and give_way is not None and give_way():
            rows = rows[:index]
            break
        try:
            row_probes = None
            if probes is not None:
                row_probes = probes[row.pk]
                if isinstance(row_probes, ApiError):
                    raise row_probes
            outcomes[row.pk] = services.run(runtime, pending.parsed, probes=row_probes)
        except ApiError as error:
            outcomes[row.pk] = error
        except Exception:
            # A row that breaks the service must not break the batch (nor run forever).
            log.exception("line %d of %s failed", row.line, row.batch_id)
            outcomes[row.pk] = internal_error()
    if rows and executions.isEnabledFor(logging.INFO):  # off by default: no join per chunk
        executions.info("executed batch=%s engine=%s lines=%s at=%.6f", rows[0].row.batch_id, rows[0].row.claimed_by,
                        ",".join(str(pending.row.line) for pending in rows), time.time())
    packed_ids = {pending.row.pk for pending in packed}
    return [_result(pending.row, endpoint, outcomes[pending.row.pk], pending.row.pk in packed_ids) for pending in rows]


def _result(row, endpoint, outcome, packed):
    request_id = new_id("req_")
    if isinstance(outcome, ApiError):
        body = outcome.management_body() if endpoint == PROBE_SCORE else outcome.body()
        failure = {"status": outcome.status, "code": outcome.code, "message": f"Line {row.line}: {outcome.message}"}
        return RowResult(row, BatchRow.Outcome.FAILED, body, failure, request_id, packed, headers=None, usage={})
    usage = outcome.body.get("usage") or {}
    return RowResult(row, BatchRow.Outcome.SUCCEEDED, outcome.body, None, request_id, packed,
                     headers=outcome.headers, usage=usage)
