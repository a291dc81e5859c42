"""The batch runner, inside the engine process (`runbatchworker`): a companion of the Worker.

Two loops share the engine's event loop:
- validation (validating.py): claims `validating` batches and validates each in a thread of its
  own, outside the admission slot;
- running (here): takes the oldest runnable batch of the resident model and runs it chunk by
  chunk, each chunk under the slot as a background holder (interactive requests go first at
  every chunk boundary, and a chunk of single rows ends at the next row once one waits), each
  chunk's rows claimed under a token of its own and recorded in one transaction fenced by it.

Its parts, each in a room of its own: the roles an engine runs a batch in (roles.py: `Leader`,
`Helper`, and which one `claim_to_run` takes), which rows run next (chunks.py, pure), running
them (the engine's `run_rows`, through `chunks.execute_rows`), the sweep (sweep.py) and the
scheduling policy (inference_app/engine/policy.py). Rows run through the very service functions
the synchronous routes call.
"""

import asyncio
import logging
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection

from batches_app import assembly, events
from batches_app.chunks import RowMemo, execute_rows, pick_chunk, seated_rows, window_size
from batches_app.models import Batch, BatchRow, FencedOut
from batches_app.roles import claim_to_run, wake_replicas
from batches_app.sweep import Sweep
from batches_app.validating import ValidationLoop
from inference_app.engine import policy
from inference_app.engine.seating import NOT_RUN
from millm_lib.errors import ApiError
from millm_lib.limits import GENERATION_ENDPOINTS, PROBE_SCORE
from projects_app.models import Project

log = logging.getLogger("millm.batches")

PROGRESS_LOG_S = 5.0
HELPERS_POLL_S = 0.1  # a leader waiting for its helpers' last chunks looks this often


def reconcile_batches(engine_id, model_id, seat=0):
    """Start-up reconciliation (see `release_claims_of_dead_engines`)."""
    released = Batch.objects.release_claims_of_dead_engines(engine_id, model_id, seat)
    if released:
        log.info("reconciled %d unfinished batch(es) left by a stopped engine", released)
    return released


class BatchRunner:
    def __init__(self, worker):
        self.worker = worker
        self.chunks = 0
        self.memo = RowMemo()
        self.throttle = events.Throttle()
        self.seated = {}  # row id -> the task running it in a seat (batched decoding)
        self.progress_log = {}  # batch id -> (started, rows done then, last logged)
        self._sweep = Sweep()
        self.validation = ValidationLoop(worker, self._sweep)
        self.rows_run = 0  # rows this engine recorded in the batch in hand (health's batch_work)

    # --- entry points the Worker calls ---

    def reconcile(self):
        return reconcile_batches(self.worker.engine_id, self.worker.source.model_id, self.worker.seat)

    async def run(self):
        await asyncio.gather(self.validation.run(), self._run_loop())

    async def swap_begins(self):
        """A load, unload or swap began on this engine (the Worker tells its companions): the
        waiting batches of the models it changes say `model_not_resident` from now, not from the
        next sweep (a running one says it at its next check, once its chunk is done)."""
        for batch in await sync_to_async(Batch.objects.note_why_waiting)():
            await events.apublish(batch)

    # --- running ---

    async def _run_loop(self):
        while not self.worker.stopping.is_set():
            batch = role = None
            try:
                if not await sync_to_async(self._sweep.anything_to_do)():
                    await self.worker.nap(settings.BATCH_WAIT_POLL_S)
                    continue
                await sync_to_async(self._sweep)()
                batch, role, verdict = await sync_to_async(claim_to_run)(self.worker)
                outcome = None if batch is None else await self._process(batch, role, verdict)
                if outcome == "ended":
                    self._forget_prefixes(batch)
                if outcome in (None, "waiting"):
                    await self.worker.nap(settings.BATCH_WAIT_POLL_S)
            except FencedOut as fenced:
                log.warning("fenced out of %s: another engine claimed it, or it is ending", fenced)
                await self._abandon_seated()
                if role is not None and role.leading:  # a no-op when the claim is another engine's now
                    await sync_to_async(self._sweep.release_or_remember)(batch)
            except Exception:
                log.exception("the batch runner failed; the batch is released and retried")
                await self._abandon_seated()
                if batch is not None and role is not None and role.leading:
                    await sync_to_async(self._sweep.release_or_remember)(batch)
                await self.worker.nap(settings.BATCH_WAIT_POLL_S)
            finally:
                if batch is not None:
                    await sync_to_async(self._let_go_of_rows)(batch)

    def _forget_prefixes(self, batch):
        """The batch ended: the shared prefixes it computed leave the engine's prefix cache now."""
        runtime = self.worker.runtime
        if batch.prefix_reuse and runtime is not None:
            dropped = runtime.prefix_cache.drop(batch.pk)
            if dropped:
                log.info("%s ended: %d cached prefix(es) it computed dropped", batch.pk, dropped)

    def _let_go_of_rows(self, batch):
        """Done with `batch` for now: our claims on its rows not recorded end, so any replica runs
        them (best effort: the sweep frees them once we stop running anyway)."""
        try:
            close_old_connections()
            BatchRow.objects.filter(batch=batch).release_claims(self.worker.engine_id)
        except Exception:
            log.warning("could not release our row claims on %s", batch.pk, exc_info=True)
        self.worker.batch_work = None

    async def _process(self, batch, role, verdict=None):
        """Run one batch in `role` until it ends or must wait (or, helping, has no rows left that
        nobody runs); "waiting" when it must wait. `verdict`: the check its claim made already,
        for the first chunk."""
        if batch.status != Batch.Status.IN_PROGRESS or batch.end_status:
            await self._assemble(batch)
            return "ended"
        # Rows parsed for an earlier claim may have been recorded since, or the model changed.
        self.memo.clear()
        self.rows_run = 0
        if verdict in ("wait", "release"):  # let go at its claim: nothing runs, no helper is wanted
            return "waiting" if verdict == "wait" else "released"
        self._report_work(batch, role)
        if role.leading:
            await wake_replicas(batch, self.worker.engine_id)  # it has a leader now: the others may help at once
        swept = time.monotonic()
        while not self.worker.stopping.is_set():
            if time.monotonic() - swept > settings.BATCH_WAIT_POLL_S:
                await sync_to_async(self._sweep)()  # the others' expiry and waiting reasons
                swept = time.monotonic()
            if verdict is None:
                verdict = await sync_to_async(self._before_chunk)(batch, role)
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
                    await self._run_seated(batch, rows, role)
                    continue
            rows = await sync_to_async(self._next_chunk)(batch)
            if rows:
                await self._run_chunk(batch, rows, role)
                continue
            left = await sync_to_async(self._rows_left)(batch)
            if left == "claimable":
                continue  # another replica took the rows we chose: choose again
            then = role.when_no_rows_left(left)
            if then == "done":
                return "ended"
            if then == "wait":
                # Helpers are running the last rows: their chunks land soon; then we finalize.
                await self.worker.nap(min(settings.BATCH_WAIT_POLL_S, HELPERS_POLL_S))
                continue
            if await sync_to_async(batch.start_finalizing)():
                await events.apublish(batch)
                await self._assemble(batch)
                return "ended"
            # cancelled meanwhile: the next check sees it
        await self._finish_seated(batch, role)
        if role.leading:
            await sync_to_async(batch.release_claim)()
        return "stopped"

    def _rows_left(self, batch):
        """"claimable" (rows nobody runs), "claimed" (rows only other engines run) or "none"."""
        if batch.rows.claimable(self.worker.engine_id).exists():
            return "claimable"
        return "claimed" if batch.rows.unrecorded().exists() else "none"

    def _report_work(self, batch, role):
        self.worker.batch_work = {"batch": batch.pk, "role": role.name, "rows_run": self.rows_run}

    def _before_chunk(self, batch, role):
        """Cancelled? expired? model resident? weights clean? lease held? The leader records the
        waiting reason if not, and lets go of the batch; a helper stops helping."""
        close_old_connections()
        batch.refresh_from_db()
        return role.check_in_transaction(batch)

    def _next_chunk(self, batch):
        """The rows the next chunk runs (PendingRows, claimed), chosen from one query's window."""
        endpoint = batch.endpoint
        size = window_size(batch, settings.BATCH_CHUNK_ROWS, settings.BATCH_PACK_MAX_ROWS)
        window = list(batch.rows.claimable(self.worker.engine_id)[:size])
        memo, runtime = self.memo, self.worker.runtime
        chunk = pick_chunk(batch, window, lambda row: memo.pending(endpoint, row).generates,
                           lambda row: memo.length(runtime, endpoint, row), settings.BATCH_PACK_MAX_ROWS)
        return self._take(endpoint, chunk)

    def _take(self, endpoint, rows):
        """`rows` run now: claimed (those another replica claimed first are left out), parsed
        (once), and out of the memo of rows still waiting."""
        chosen = list(rows)
        return self.memo.taken(endpoint, BatchRow.objects.claim(chosen, self.worker.engine_id), chosen)

    async def _run_chunk(self, batch, rows, role):
        seating = self.worker.seating
        probes = None
        if batch.endpoint == PROBE_SCORE:
            probes = await sync_to_async(self._probes_of)(batch, rows)
        results = await seating.exclusive(
            batch.model, execute_rows, batch.endpoint, rows, probes, batch.pack, seating.give_way, _reuse(batch)
        )
        if results is NOT_RUN:
            results = []  # a swap or a weights edit took the slot first: the next check makes the batch wait
        if results:
            await self._record(batch, results, role)
        if len(results) < len(rows):  # the chunk gave way to a chat: the rest is anyone's again
            ran = {result.row.pk for result in results}
            await sync_to_async(BatchRow.objects.release_claims)(
                self.worker.engine_id, [pending.row for pending in rows if pending.row.pk not in ran]
            )

    async def _record(self, batch, results, role):
        if settings.BATCH_TEST_PAUSE_BEFORE_RECORD_S:
            await asyncio.sleep(settings.BATCH_TEST_PAUSE_BEFORE_RECORD_S)  # tests kill the engine here
        self.chunks += 1
        await sync_to_async(batch.record_chunk)(results, self.chunks, self.worker.engine_id, role.leading)
        self.rows_run += len(results)
        self._report_work(batch, role)
        await self.on_progress(batch)

    # --- batched decoding: generation rows in seats of their own ---

    def _decodes_batched(self, batch):
        return batch.batched_decoding and self.worker.seating.batched and batch.endpoint in GENERATION_ENDPOINTS

    def _next_seated_rows(self, batch):
        """The next generation rows in file order that are not in flight, as many as the seats a
        batch may take (the policy's `batch_seats`) leave room for."""
        room = policy.batch_seats(self.worker.seating.seats) - len(self.seated)
        if room <= 0:
            return []
        window = batch.rows.claimable(self.worker.engine_id).exclude(pk__in=list(self.seated))[:room]
        return self._take(batch.endpoint, seated_rows(window, lambda row: self.memo.pending(batch.endpoint, row).generates))

    async def _run_seated(self, batch, rows, role):
        """Start `rows` (PendingRows), each in a background seat; wait until one or more of the
        rows in flight is done (or a second passes), and record those in one fenced transaction."""
        seating = self.worker.seating
        for pending in rows:
            self.seated[pending.row.pk] = asyncio.create_task(
                seating.seated(batch.model, execute_rows, batch.endpoint, [pending], choices=pending.choices,
                               reuse_prefix=_reuse(batch))
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
            await self._record(batch, results, role)
        if not_run:
            await sync_to_async(BatchRow.objects.filter(pk__in=not_run).release_claims)(self.worker.engine_id)

    async def _finish_seated(self, batch, role):
        """A stop: the rows in flight finish and are recorded; no new row starts."""
        while self.seated:
            await self._run_seated(batch, [], role)

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

    # --- ends and progress ---

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


def _reuse(batch):
    """What a batch's rows run with: its id, which the prefixes they compute belong to, when it
    reuses prefixes; else False."""
    return batch.pk if batch.prefix_reuse else False
