"""Batches and their rows. PostgreSQL is the truth: every transition is a compare-and-set, and a
chunk's results and the batch's counts are written in one transaction fenced by the claim token."""

import json
import logging
import uuid
from dataclasses import dataclass

from django.db import connection, connections, models, transaction
from django.db.models import Case, Count, Exists, F, OuterRef, Q, Sum, Value, When
from django.db.models.functions import Coalesce
from django.utils import timezone
from psycopg.types.json import Jsonb

from batches_app import leasing, lifecycle
from batches_app.shapes import (
    BatchErrors,
    BatchMillm,
    BatchObject,
    BatchUsage,
    CachedTokens,
    ReasoningTokens,
    RequestCounts,
)
from files_app.models import File, IdempotencyKey
from inference_app.engine import policy
from inference_app.models import Engine, Lease
from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from projects_app.models import OwnedQuerySet, Project, quota_exceeded
from millm_lib.pagination import cursor_page
from responses_app.models import StoredResponse
from webhooks_app.models import Delivery



log = logging.getLogger("millm.batches")

# A batch's rows still to run: total less completed and failed. Its total is known once it is
# validated; until then its input file's lines stand for it.
QUEUED_ROWS = Case(
    When(status="validating", total=0, then=F("input_file__line_count")),
    default=F("total") - F("completed") - F("failed"),
)


# The batch quotas' use, as aggregates: over one project's batches, or grouped by project.
BATCH_QUOTA_USE = {"active_batches": Count("id"), "queued_rows": Coalesce(Sum(QUEUED_ROWS), 0)}


# A batch let go of: one whose rows wait keeps the reason it had, or says `queued` (the sweep
# refines it to `model_not_resident` when no engine serves its model); others keep theirs.
WAITING_ONCE_UNCLAIMED = Case(
    When(status="in_progress", end_status__isnull=True, then=Coalesce("waiting_reason", Value("queued"))),
    default=F("waiting_reason"),
)


class FencedOut(Exception):
    """Another engine claimed the batch since we did: stop touching it."""


class BatchQuerySet(OwnedQuerySet):
    def unfinished(self):
        return self.filter(status__in=Batch.UNFINISHED)

    def queued_rows(self):
        """The rows these batches still have to run (the queued_rows quota counts its project's
        unfinished batches: a batch that ends frees its rows at once)."""
        return self.aggregate(rows=BATCH_QUOTA_USE["queued_rows"])["rows"]

    def quota_use(self):
        """{quota: use} of a project's batches: its unfinished ones and the rows they still have
        to run. The one count of the batch quotas (`refuse_over_quotas`, the admin, /metrics)."""
        return self.unfinished().aggregate(**BATCH_QUOTA_USE)

    def page(self, after=None, limit=20):
        return cursor_page(self, after, limit)

    def to_validate(self):
        return self.filter(status=Batch.Status.VALIDATING)

    def to_run(self, resident_model_id):
        """What an engine with `resident_model_id` resident (None: none is) may run. Ending needs
        no model: any engine assembles a finalizing, cancelling or expired batch."""
        runnable = Q(status__in=[Batch.Status.FINALIZING, Batch.Status.CANCELLING])
        runnable |= Q(status=Batch.Status.IN_PROGRESS, end_status__isnull=False)
        if resident_model_id is not None:
            runnable |= Q(status=Batch.Status.IN_PROGRESS, model=resident_model_id)
        return self.filter(runnable)

    def led_elsewhere(self, resident_model_id, engine_id):
        """Batches of `resident_model_id` whose rows run, led by another running replica, oldest
        first."""
        return (
            self.filter(status=Batch.Status.IN_PROGRESS, end_status__isnull=True, model=resident_model_id,
                        claimed_by__in=_running_engines())
            .exclude(claimed_by=engine_id)
            .order_by("created_at", "id")
        )

    def to_help(self, resident_model_id, engine_id):
        """Batches another running replica leads with rows that nobody runs, or that `engine_id`
        claimed and has not run (a release that failed): `engine_id` may run chunks of them
        (SPEC 10c), oldest first."""
        free_rows = BatchRow.objects.filter(batch=OuterRef("pk"), outcome=BatchRow.Outcome.PENDING).filter(
            Q(claimed_by__isnull=True) | Q(claimed_by=engine_id))
        return self.led_elsewhere(resident_model_id, engine_id).filter(Exists(free_rows))

    def waiting(self):
        """In progress, unclaimed and not ending: rows waiting for an engine to run them."""
        return self.filter(status=Batch.Status.IN_PROGRESS, claimed_by__isnull=True, end_status__isnull=True)

    # --- claims (the fencing tokens) ---

    def claim_oldest(self, engine_id, running_before=None):
        """The oldest unclaimed batch of these (ending ones first), claimed by `engine_id` with a
        fresh fencing token, or None. `running_before`: a batch whose rows are to run is taken only
        if it was created before then (an older batch another replica leads comes first).

        SELECT ... FOR UPDATE SKIP LOCKED: two engines never pick the same row at once.
        """
        with transaction.atomic():
            candidates = (
                self.select_for_update(skip_locked=True)
                .filter(claimed_by__isnull=True)
                .annotate(runs_rows=Case(When(Q(status=Batch.Status.IN_PROGRESS, end_status__isnull=True), then=1), default=0))
            )
            batch = candidates.filter(policy.claimable_beside(running_before)).order_by(*policy.NEXT_BATCH_ORDER).first()
            if batch is None or batch.claim(engine_id) is None:
                return None
        return batch

    def release_claims_of_dead_engines(self, engine_id, model_id, seat=0):
        """Start-up reconciliation: release the batch and row claims no running engine can still
        act on.

        Claims of engines that held our seat of our model (or came before seats) are dead: we
        hold that seat's advisory lock, which PostgreSQL gave us only once the previous holder's
        process was gone (its heartbeat may still look fresh). Engines whose heartbeat is stale,
        or whose seat another replica saw free (`Presence.notice_dead_replicas`), are dead too.
        Released batches are picked up again by status: validating validates again; in_progress
        resumes at its first unrecorded row; finalizing assembles again; cancelling ends cancelled.
        """
        same_seat = list(Engine.objects.filter(model_id=model_id).filter(Q(seat=seat) | Q(seat__isnull=True))
                         .exclude(pk=engine_id).values_list("pk", flat=True))
        BatchRow.objects.release_claims_of(same_seat)
        released = self.unfinished().filter(claimed_by__in=same_seat).update(
            claimed_by=None, claim_token=None, waiting_reason=WAITING_ONCE_UNCLAIMED)
        return released + self.release_stale_claims()

    def release_stale_claims(self):
        """Claims of engines no longer running (never a running engine's): batches and rows."""
        BatchRow.objects.release_dead_claims()
        return self.unfinished().exclude(claimed_by=None).exclude(claimed_by__in=_running_engines()).update(
            claimed_by=None, claim_token=None, waiting_reason=WAITING_ONCE_UNCLAIMED
        )

    # --- the sweep over unclaimed batches ---

    def note_why_waiting(self):
        """Each waiting batch says why: `queued` while a live engine has its model resident,
        `model_not_resident` while none has, or while the one that has is loading or unloading
        (a swap). Returns the batches whose reason changed, as they are now, for their
        `batch:progress` (a change of reason is a change like any other)."""
        serving = set(Engine.objects.serving_batches().values_list("resident_model_id", flat=True))
        waiting = self.waiting()
        changes = (
            (waiting.filter(model__in=serving, waiting_reason__in=[None, Batch.Waiting.MODEL_NOT_RESIDENT]),
             Batch.Waiting.QUEUED),
            (waiting.exclude(model__in=serving).exclude(waiting_reason=Batch.Waiting.MODEL_NOT_RESIDENT),
             Batch.Waiting.MODEL_NOT_RESIDENT),
        )
        changed = []
        for batches, reason in changes:
            ids = list(batches.values_list("pk", flat=True))
            # Claimed meanwhile (another engine's sweep or claim): the filters hold in the UPDATE,
            # and only the batches now holding `reason` are announced.
            if ids and batches.filter(pk__in=ids).update(waiting_reason=reason):
                changed += Batch.objects.filter(pk__in=ids, waiting_reason=reason)
        return changed

    def ended_before(self, moment):
        """Batches that ended (any end) before `moment`."""
        ended_at = Coalesce("completed_at", "failed_at", "expired_at", "cancelled_at")
        return self.filter(status__in=Batch.ENDED).alias(ended_at=ended_at).filter(ended_at__lt=moment)

    def delete_ended(self):
        """The ended batches of these deleted, their rows with them; an unfinished one is left
        (an engine may be writing its rows). Returns how many batches went."""
        with transaction.atomic():
            ended = list(self.exclude(status__in=Batch.UNFINISHED).select_for_update().values_list("pk", flat=True))
            Batch.objects.filter(pk__in=ended).exclude(status__in=Batch.UNFINISHED).delete()
        return len(ended)

    def expire_waiting(self):
        """Waiting batches past expires_at end expired (the next engine to claim one assembles it)."""
        return self.waiting().filter(Batch.past_window(timezone.now())).update(end_status=Batch.Status.EXPIRED)


def _running_engines():
    """The running engines' ids, as a subquery of the statement that reads them."""
    return Engine.objects.running().values("pk")


class Batch(models.Model):
    # The life cycle's vocabulary (lifecycle.py), where the code that moves batches reads it.
    Status = lifecycle.Status
    Waiting = lifecycle.Waiting
    UNFINISHED = lifecycle.UNFINISHED
    ENDED = lifecycle.ENDED

    id = models.CharField(primary_key=True, max_length=40)
    endpoint = models.CharField(max_length=64)
    model = models.CharField(max_length=255, null=True, blank=True)
    input_file = models.ForeignKey(File, on_delete=models.PROTECT, related_name="input_of")
    output_file = models.ForeignKey(File, on_delete=models.PROTECT, null=True, blank=True, related_name="output_of")
    error_file = models.ForeignKey(File, on_delete=models.PROTECT, null=True, blank=True, related_name="errors_of")
    completion_window = models.CharField(max_length=8)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    total = models.IntegerField(default=0)
    completed = models.IntegerField(default=0)
    failed = models.IntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)  # input tokens a cached prefix held (prefix_reuse)
    output_tokens = models.BigIntegerField(default=0)
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)
    pack = models.BooleanField(default=False)
    pack_window = models.IntegerField(default=0)
    batched_decoding = models.BooleanField(default=False)
    # Shared prefixes from the engine's prefix cache (issue 45): packed rows and seated generation.
    prefix_reuse = models.BooleanField(default=False)
    output_expires_after = models.IntegerField(null=True, blank=True)
    lease = models.ForeignKey(Lease, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    lease_mode = models.CharField(max_length=8, null=True, blank=True)  # leasing.OWN | leasing.CALLER
    waiting_reason = models.CharField(max_length=24, choices=Waiting.choices, null=True, blank=True)
    claimed_by = models.CharField(max_length=40, null=True, blank=True)
    claim_token = models.UUIDField(null=True, blank=True)
    # The end a cancel, an expiry or a failure asked for; finalization stamps it.
    end_status = models.CharField(max_length=16, null=True, blank=True)
    project = models.ForeignKey("projects_app.Project", null=True, blank=True, on_delete=models.PROTECT,
                                related_name="+", help_text="The project that made it (SPEC 10d).")

    objects = BatchQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "batches"
        indexes = [models.Index(fields=["status", "created_at"])]

    def __str__(self):
        return f"batch {self.id} ({self.status})"

    @property
    def holder(self):
        """The holder name of the lease the batch takes in its own name."""
        return leasing.holder_of(self.id)

    def due_end(self, now=None):
        """The end this batch is due at `now` (default: now), whatever runs it: cancelled once a
        cancel was asked, expired once its completion window has passed (`expires_at`, included);
        None while it may run on. The one rule of expiry: `past_window` is its query form."""
        if self.status == self.Status.CANCELLING:
            return self.Status.CANCELLED
        if (now or timezone.now()) >= self.expires_at:
            return self.Status.EXPIRED
        return None

    @staticmethod
    def past_window(now):
        """`due_end`'s expiry as a filter: batches whose completion window has passed at `now`."""
        return Q(expires_at__lte=now)

    @property
    def unrun_code(self):
        return {
            self.Status.CANCELLED: "batch_cancelled",
            self.Status.EXPIRED: "batch_expired",
            self.Status.FAILED: "batch_failed",
        }.get(self.end_status)

    # --- transitions (compare-and-set; a count other than 1 means someone got there first) ---

    def _move(self, expected, status, fenced_by=None, **fields):
        """From one of `expected` to `status`, stamping its time; with `fenced_by`, only while
        that claim token still holds the batch."""
        stamp = {f"{status}_at": timezone.now()} if f"{status}_at" in {f.name for f in self._meta.fields} else {}
        fence = {} if fenced_by is None else {"claim_token": fenced_by}
        updated = Batch.objects.filter(pk=self.pk, status__in=expected, **fence).update(status=status, **stamp, **fields)
        if updated == 1:
            self.refresh_from_db()
        return updated == 1

    def request_cancel(self):
        """POST .../cancel and the admin action. Returns the batch; 409 once it has ended."""
        if self.status == self.Status.CANCELLING:
            return self
        if self._move([self.Status.VALIDATING, self.Status.IN_PROGRESS], self.Status.CANCELLING):
            return self
        self.refresh_from_db()
        if self.status in (self.Status.CANCELLING,):
            return self
        raise ApiError(
            409,
            "batch_state_conflict",
            f"The batch '{self.id}' is {self.status}; only a validating or in-progress batch can be cancelled",
            param="batch_id",
        )

    def hand_lease(self, header, project=None):
        """POST .../lease: run under the caller's live lease from now on; our own is released.
        The lease must be the caller's `project`'s (by default the batch's own project's):
        another project's is unknown."""
        lease = leasing.lease_to_hand_over(self, header, project or self.project or Project.objects.default())
        updated = Batch.objects.filter(pk=self.pk, status__in=self.UNFINISHED).update(lease=lease, lease_mode=leasing.CALLER)
        if updated != 1:
            self.refresh_from_db()
            raise ApiError(
                409, "batch_state_conflict",
                f"The batch '{self.id}' is {self.status}; a lease is handed only to an unfinished batch",
                param="batch_id",
            )
        # Not refreshed yet: the batch still names the lease it ran under before the hand-over.
        leasing.release_own(self, "handed over to the caller's lease")
        self.refresh_from_db()
        return self

    def insert(self, idempotency_key=None, recheck_input=None):
        """POST /v1/batches: the new batch and its Idempotency-Key, in one transaction.

        1. The project's row is locked and its quotas checked: a racing create of the same
           project waits here, then counts this batch.
        2. The input file's row is locked, then `recheck_input(file id)` runs: a DELETE of that
           file locks it too, so it cannot slip in between the check and our commit.
        """
        with transaction.atomic():
            if self.project is not None:
                self.refuse_over_quotas(self.project.lock_for_quotas())
            File.objects.select_for_update().filter(pk=self.input_file_id).first()
            if recheck_input is not None:
                recheck_input(self.input_file_id)
            self.save(force_insert=True)
            if idempotency_key:
                IdempotencyKey.objects.create(scope="batch", key=idempotency_key, object_id=self.pk, project=self.project)

    def refuse_over_quotas(self, project):
        """429 quota_exceeded when this new batch would pass `project`'s active_batches (it adds
        one) or queued_rows (it adds its input file's lines)."""
        use = None
        for quota, adding in (("active_batches", 1), ("queued_rows", self.input_file.line_count)):
            if project.limit(quota) is None:
                continue
            use = use or Batch.objects.filter(project=project).quota_use()
            refusal = quota_exceeded(project, quota, use[quota], adding)
            if refusal is not None:
                raise refusal

    def rows_per_second(self, now=None):
        """Rows recorded per second since the batch started running; None unless it runs.
        (The engine's log line measures since its own claim, which a restart resets.)"""
        if self.status != self.Status.IN_PROGRESS or self.in_progress_at is None:
            return None
        seconds = ((now or timezone.now()) - self.in_progress_at).total_seconds()
        return (self.completed + self.failed) / seconds if seconds > 0 else 0.0

    def to_openai(self):
        def stamp(value):
            return int(value.timestamp()) if value else None

        errors = None
        if self.errors:
            errors = BatchErrors(object="list", data=self.errors[:100])
        return BatchObject(
            id=self.id,
            object="batch",
            endpoint=self.endpoint,
            model=self.model,
            errors=errors,
            input_file_id=self.input_file_id,
            completion_window=self.completion_window,
            status=self.status,
            output_file_id=self.output_file_id,
            error_file_id=self.error_file_id,
            created_at=stamp(self.created_at),
            in_progress_at=stamp(self.in_progress_at),
            expires_at=stamp(self.expires_at),
            finalizing_at=stamp(self.finalizing_at),
            completed_at=stamp(self.completed_at),
            failed_at=stamp(self.failed_at),
            expired_at=stamp(self.expired_at),
            cancelling_at=stamp(self.cancelling_at),
            cancelled_at=stamp(self.cancelled_at),
            request_counts=RequestCounts(total=self.total, completed=self.completed, failed=self.failed),
            metadata=self.metadata,
            usage=BatchUsage(
                input_tokens=self.input_tokens,
                input_tokens_details=CachedTokens(cached_tokens=self.cached_tokens),
                output_tokens=self.output_tokens,
                output_tokens_details=ReasoningTokens(reasoning_tokens=0),
                total_tokens=self.input_tokens + self.output_tokens,
            ),
            millm=BatchMillm(
                pack=self.pack,
                pack_window=self.pack_window,
                batched_decoding=self.batched_decoding,
                prefix_reuse=self.prefix_reuse,
                waiting_reason=self.waiting_reason if self.status == self.Status.IN_PROGRESS else None,
                lease_mode=self.lease_mode,
                output_expires_after=self.output_expires_after,
            ),
        )

    # --- the runner's writes, fenced by the claim token ---

    def claim(self, engine_id):
        token = uuid.uuid4()
        updated = Batch.objects.filter(pk=self.pk, claimed_by__isnull=True).update(claimed_by=engine_id, claim_token=token)
        if updated != 1:
            return None
        self.claimed_by, self.claim_token = engine_id, token
        return token

    def fenced(self):
        """The batch row, locked, if our claim still holds; else FencedOut."""
        locked = Batch.objects.select_for_update().filter(pk=self.pk, claim_token=self.claim_token).first()
        if locked is None:
            raise FencedOut(self.pk)
        return locked

    def release_claim(self):
        """Unclaimed, to be picked up again by its status; a runner fenced out releases nothing
        (the batch is another engine's now). A batch whose rows wait says why (`queued` unless a
        reason was recorded; the sweep refines it)."""
        Batch.objects.filter(pk=self.pk, claim_token=self.claim_token).update(
            claimed_by=None, claim_token=None, waiting_reason=WAITING_ONCE_UNCLAIMED)

    def set_waiting(self, reason):
        if self.waiting_reason != reason:
            Batch.objects.filter(pk=self.pk, claim_token=self.claim_token).update(waiting_reason=reason)
            self.waiting_reason = reason
            return True
        return False

    def take_own_lease(self, lease):
        """The batch runs under `lease`, acquired in its own name (see leasing.hold)."""
        Batch.objects.filter(pk=self.pk, claim_token=self.claim_token).update(lease=lease, lease_mode=leasing.OWN)
        self.lease_id, self.lease_mode = lease.pk, leasing.OWN

    def mark_ending(self, end_status):
        """The runner saw a cancel or the expiry: assembly ends the batch `end_status`."""
        Batch.objects.filter(pk=self.pk).update(end_status=end_status)
        self.end_status = end_status

    def start_finalizing(self):
        """Every row recorded: in_progress to finalizing. False when a cancel got there first
        (the runner's next check sees it)."""
        return self._move([self.Status.IN_PROGRESS], self.Status.FINALIZING)

    def record_chunk(self, results, chunk, engine_id, leading=True):
        """Write a chunk's results (RowResults) and the batch's counts in one transaction, fenced.

        One UPDATE writes every row, and only rows still pending and still under the claim their
        chunk took: a recorded row is never written again. A row whose claim was lost meanwhile
        (we looked dead to another replica's sweep, which freed it) is not written and not
        counted: another engine runs or ran it. The leader's chunk is fenced by the batch's claim token too;
        a helper's (a replica running rows of a batch another replica leads) only while the batch
        runs and no end was asked for: assembly begins after `mark_ending` or `start_finalizing`,
        each an update of the batch row this transaction locks, so a helper's chunk lands before
        assembly reads the rows, or not at all.
        """
        with transaction.atomic():
            if leading:
                self.fenced()
            else:
                locked = Batch.objects.select_for_update().filter(pk=self.pk).first()
                if locked is None or locked.status != self.Status.IN_PROGRESS or locked.end_status:
                    raise FencedOut(f"{self.pk} is ending: a helper's chunk is not recorded")
            written = BatchRow.objects.record(results, chunk, timezone.now(), engine_id)
            lost = [result.row.line for result in results if result.row.pk not in written]
            if lost:
                log.warning("lines %s of %s were recorded by another engine or their claim is no longer ours: "
                            "not written", lost, self.pk)
                results = [result for result in results if result.row.pk in written]
            succeeded = [result.usage for result in results if result.outcome == BatchRow.Outcome.SUCCEEDED]
            Batch.objects.filter(pk=self.pk).update(
                completed=F("completed") + len(succeeded),
                failed=F("failed") + len(results) - len(succeeded),
                input_tokens=F("input_tokens") + sum(usage.get("prompt_tokens", 0) for usage in succeeded),
                cached_tokens=F("cached_tokens") + sum(cached_tokens(usage) for usage in succeeded),
                output_tokens=F("output_tokens") + sum(usage.get("completion_tokens", 0) for usage in succeeded),
                waiting_reason=None,
            )
            for result in results:
                if result.kept is not None:  # a /v1/responses row that asked to be stored
                    StoredResponse.keep(result.response, result.kept, self.project)
        self.refresh_from_db(fields=["completed", "failed", "input_tokens", "cached_tokens", "output_tokens",
                                     "waiting_reason", "status"])

    # --- validation's writes, fenced by the claim token ---

    def discard_rows(self):
        """Validating again after a crash starts clean: the rows the dead run stored go."""
        with transaction.atomic():
            self.fenced()
            BatchRow.objects.filter(batch=self).delete()

    def insert_rows(self, rows):
        """Insert `rows` (see `BatchRowQuerySet.copy_in`) while our claim holds and the batch
        still validates; False otherwise (a cancel, or another engine took it over: stop)."""
        with transaction.atomic():
            locked = Batch.objects.select_for_update().filter(pk=self.pk, claim_token=self.claim_token).first()
            if locked is None or locked.status != self.Status.VALIDATING:
                return False
            BatchRow.objects.copy_in(self, rows)
        return True

    def fail_validation(self, **fields):
        """Still validating, it is to end failed (assembly ends it), with `fields` (the errors);
        False when cancelled or taken over meanwhile."""
        updated = Batch.objects.filter(pk=self.pk, claim_token=self.claim_token, status=self.Status.VALIDATING).update(
            end_status=self.Status.FAILED, **fields
        )
        return updated == 1

    def queue_to_run(self, **fields):
        """Validated: in progress, `queued`, and our claim released, in one fenced update. The
        validating engine (maybe of another model) never holds a batch whose rows wait to run."""
        return self._move([self.Status.VALIDATING], self.Status.IN_PROGRESS, fenced_by=self.claim_token,
                          waiting_reason=self.Waiting.QUEUED, claimed_by=None, claim_token=None, **fields)

    # --- assembly's write ---

    def finish(self, end, output_file, error_file):
        """The batch's end, in one transaction, fenced: the files recorded and attached, the end
        status stamped, its own lease ended, the rows' bodies deleted. Returns the end it stamped.

        Fenced: an engine that lost its claim leaves only bytes, which the orphan sweep
        removes; never a listed file no batch owns. An ended batch keeps its claim, so the
        status is checked too: a second assembly of an ended batch changes nothing and
        returns None (its caller removes the bytes it saved).
        """
        with transaction.atomic():
            locked = self.fenced()
            if locked.status not in self.UNFINISHED:
                return None
            for file in (output_file, error_file):
                if file is not None:
                    file.record_stored()
            if locked.status == self.Status.CANCELLING and end == self.Status.FAILED and self.in_progress_at is None:
                end = self.Status.CANCELLED  # cancelled while validating: the cancel wins
            ended_at = timezone.now()
            Batch.objects.filter(pk=self.pk).update(
                status=end, output_file=output_file, error_file=error_file, waiting_reason=None,
                **{f"{end}_at": ended_at},
            )
            # The batch's own lease ends in the same transaction: a replica that saw the batch
            # ended with its lease still live took the lease for a crash's leftover and
            # superseded it (test_replicas_inprocess, seen once).
            leasing.release_own(locked, "the batch ended")
            # batch.completed, .failed, .expired or .cancelled, to each subscribed endpoint, in
            # this transaction: a crash between the end and its delivery cannot lose the event.
            Delivery.objects.enqueue(lifecycle.end_event_type(end), {"id": self.pk}, ended_at, project=self.project)
            # The files are the truth now: a row keeps what the console and resume read (line,
            # custom_id, outcome, request id, packed), not the request, the answer (embedding
            # vectors), the error or the headers.
            BatchRow.objects.filter(batch=self).update(body=None, response=None, error=None, headers=None)
        return end


@dataclass(frozen=True, slots=True)
class RowResult:
    """One row's result, as the runner made it and `record_chunk` writes it."""

    row: "BatchRow"
    outcome: str
    response: dict | None
    error: dict | None  # {status, code, message} of a failed row
    request_id: str
    packed: bool
    headers: dict | None
    usage: dict
    kept: list | None = None  # a /v1/responses row stored as a response: the input items it keeps

    @property
    def batched(self):
        # A row that shared its decode steps says so in its header (SPEC 8a) and its column.
        return (self.headers or {}).get("X-miLLM-Backend") == "batched"


class BatchRowQuerySet(models.QuerySet):
    def copy_in(self, batch, rows):
        """Store a batch's validated lines: each (line, custom_id, body, error), a pending row
        where `error` is None, else an invalid one. One COPY, not `bulk_create`: building a model
        instance and adapting each of its fields took three quarters of a 50,000-line
        validation (bench/FINDINGS.md)."""
        pending, invalid = BatchRow.Outcome.PENDING, BatchRow.Outcome.INVALID
        given = ["batch_id", "line", "custom_id", "body", "outcome", "error"]
        # Every other field with a default (packed, batched) as a new instance has it; the rest NULL.
        defaulted = [field for field in BatchRow._meta.concrete_fields if field.has_default() and field.column not in given]
        defaults = tuple(field.get_default() for field in defaulted)
        columns = ", ".join(given + [field.column for field in defaulted])
        statement = f"COPY {BatchRow._meta.db_table} ({columns}) FROM STDIN"
        with connections[self.db].cursor() as cursor, cursor.copy(statement) as copy:
            for line, custom_id, body, error in rows:
                copy.write_row((batch.pk, line, custom_id, None if body is None else Jsonb(body),
                                pending if error is None else invalid, None if error is None else Jsonb(error), *defaults))

    def unrecorded(self):
        return self.filter(outcome=BatchRow.Outcome.PENDING).order_by("line")

    def claimable(self, engine_id):
        """Pending rows nobody runs now, or that `engine_id` claimed and has not run (the rest of
        a chunk that gave way), in line order."""
        return self.unrecorded().filter(Q(claimed_by__isnull=True) | Q(claimed_by=engine_id))

    def claim(self, rows, engine_id):
        """Claim `rows` (BatchRows) for `engine_id` under one fresh token: the ones it got, each
        with that token set, in the order given.

        SELECT ... FOR UPDATE SKIP LOCKED: a row another replica is claiming at this instant is
        skipped, not waited for; a row claimed already (by someone else) is not taken.
        """
        if not rows:
            return []
        token = uuid.uuid4()
        with transaction.atomic():
            free = list(
                self.select_for_update(skip_locked=True)
                .filter(pk__in=[row.pk for row in rows], outcome=BatchRow.Outcome.PENDING)
                .filter(Q(claimed_by__isnull=True) | Q(claimed_by=engine_id))
                .values_list("pk", flat=True)
            )
            BatchRow.objects.filter(pk__in=free).update(claimed_by=engine_id, claim_token=token)
        got = set(free)
        for row in rows:
            if row.pk in got:
                row.claimed_by, row.claim_token = engine_id, token
        return [row for row in rows if row.pk in got]

    def release_claims(self, engine_id, rows=None):
        """`engine_id`'s claims on these pending rows end (it stops running them); `rows`: only
        those."""
        mine = self.filter(claimed_by=engine_id, outcome=BatchRow.Outcome.PENDING)
        if rows is not None:
            mine = mine.filter(pk__in=[row.pk for row in rows])
        return mine.update(claimed_by=None, claim_token=None)

    def release_claims_of(self, engine_ids):
        return self.filter(claimed_by__in=engine_ids).update(claimed_by=None, claim_token=None)

    def release_dead_claims(self):
        """Claims of engines no longer running (dead, demoted, stopped): their rows run again."""
        return self.filter(claimed_by__isnull=False).exclude(claimed_by__in=_running_engines()).update(
            claimed_by=None, claim_token=None
        )

    def backlog(self):
        """{(model, status): rows}: each valid row not yet run of each active batch, once, whichever
        engines serve its model (the seed's `batch_backlog_rows`): in-progress batches with no end
        asked for, waiting or running, their model resident or not; validating batches with the
        valid lines read so far (their model is "" until validation names it)."""
        active = Q(batch__status__in=[Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS], batch__end_status__isnull=True)
        counted = (self.filter(active, outcome=BatchRow.Outcome.PENDING).order_by()
                   .values_list("batch__model", "batch__status").annotate(rows=Count("id")))
        return {(model or "", status): rows for model, status, rows in counted}

    def record(self, results, chunk, recorded_at, engine_id):
        """One UPDATE for a chunk's RowResults, each row written only while still pending and
        still claimed by `engine_id` under the token it was claimed with; the claim ends and
        `ran_by` names the engine. Returns the ids it wrote."""
        if not results:
            return set()
        table = BatchRow._meta.db_table
        values = ", ".join(["(%s::bigint, %s, %s::text, %s::jsonb, %s, %s::boolean, %s::boolean, %s::jsonb, %s::uuid)"]
                           * len(results))
        params = []
        for result in results:
            params += [result.row.pk, result.outcome, BatchRow.response.field.get_prep_value(result.response), _jsonb(result.error),
                       result.request_id, result.packed, result.batched, _jsonb(result.headers), result.row.claim_token]
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} AS r SET outcome = v.outcome, response = v.response, error = v.error, "
                f"request_id = v.request_id, packed = v.packed, batched = v.batched, headers = v.headers, chunk = %s, "
                f"recorded_at = %s, ran_by = %s, claimed_by = NULL, claim_token = NULL "
                f"FROM (VALUES {values}) AS v(id, outcome, response, error, request_id, packed, batched, headers, token) "
                f"WHERE r.id = v.id AND r.outcome = %s AND r.claimed_by = %s AND r.claim_token = v.token RETURNING r.id",
                [chunk, recorded_at, engine_id, *params, BatchRow.Outcome.PENDING, engine_id],
            )
            return {row[0] for row in cursor.fetchall()}


def cached_tokens(usage):
    """A row's prompt tokens that a cached prefix held (its usage's prompt_tokens_details)."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _jsonb(value):
    """A JSONField value as the UPDATE's parameter: None is SQL NULL, as Django stores it."""
    return None if value is None else json.dumps(value)


class JSONText(models.TextField):
    """A JSON value stored as its text: a generated answer may hold U+0000 (a byte-fallback
    token), which jsonb refuses outright but JSON text escapes as \\u0000. One such answer in
    a jsonb column failed its whole chunk, which ran again, forever."""

    def from_db_value(self, value, expression, connection):
        return None if value is None else json.loads(value)

    def to_python(self, value):
        return json.loads(value) if isinstance(value, str) else value

    def get_prep_value(self, value):
        return None if value is None else json.dumps(value)


class BatchRow(models.Model):
    class Outcome(models.TextChoices):
        PENDING = "pending"
        SUCCEEDED = "succeeded"
        FAILED = "failed"  # failed on its own merits at run time
        INVALID = "invalid"  # refused at validation

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="rows")
    line = models.IntegerField()
    custom_id = models.CharField(max_length=512, null=True, blank=True)
    body = models.JSONField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.PENDING)
    request_id = models.CharField(max_length=40, null=True, blank=True)
    response = JSONText(null=True, blank=True)  # the answer's body, until the files are recorded
    error = models.JSONField(null=True, blank=True)
    packed = models.BooleanField(default=False)
    batched = models.BooleanField(default=False)  # its sequence shared decode steps with others
    headers = models.JSONField(null=True, blank=True)
    chunk = models.IntegerField(null=True, blank=True)
    recorded_at = models.DateTimeField(null=True, blank=True)
    # A pending row an engine is running now (SPEC 10c: rows are claimed in chunks, each chunk
    # fenced by its own token); cleared when it is recorded or released.
    claimed_by = models.CharField(max_length=40, null=True, blank=True)
    claim_token = models.UUIDField(null=True, blank=True)
    ran_by = models.CharField(max_length=40, null=True, blank=True, help_text="The engine that recorded it.")

    objects = BatchRowQuerySet.as_manager()

    class Meta:
        ordering = ["batch", "line"]
        constraints = [
            # The database itself refuses a second row, and so a second result, for a line.
            models.UniqueConstraint(fields=["batch", "line"], name="one_row_per_line"),
            models.UniqueConstraint(
                fields=["batch", "custom_id"], condition=~Q(outcome="invalid"), name="one_valid_row_per_custom_id"
            ),
        ]
        indexes = [
            models.Index(fields=["batch", "outcome", "line"]),
            # Claims are few at any time (a chunk per engine): the sweep for dead ones reads this.
            models.Index(fields=["claimed_by"], condition=Q(claimed_by__isnull=False), name="batchrow_claimed"),
        ]

    def __str__(self):
        return f"line {self.line} of {self.batch_id}"

    def output_line(self, unrun_code=None):
        """(is_output, the JSONL object) for the output or the error file."""
        line_id = new_id("batch_req_")
        if self.outcome == self.Outcome.SUCCEEDED:
            response = {"status_code": 200, "request_id": self.request_id, "body": self.response,
                        "millm": {"packed": self.packed, "batched": self.batched,
                                  "prefix_tokens_reused": cached_tokens((self.response or {}).get("usage") or {}),
                                  "headers": self.headers or {}}}
            return True, {"id": line_id, "custom_id": self.custom_id, "response": response, "error": None}
        if self.outcome == self.Outcome.FAILED:
            response = {"status_code": self.error["status"], "request_id": self.request_id, "body": self.response}
            error = {"code": self.error["code"], "message": self.error["message"]}
            return False, {"id": line_id, "custom_id": self.custom_id, "line": self.line, "response": response, "error": error}
        if self.outcome == self.Outcome.INVALID:
            return False, {"id": line_id, "custom_id": self.custom_id, "line": self.line, "response": None, "error": self.error}
        message = {
            "batch_cancelled": "the batch was cancelled before this line ran",
            "batch_expired": "the batch expired before this line ran",
            "batch_failed": "the batch failed before this line ran",
        }[unrun_code]
        error = {"code": unrun_code, "message": f"Line {self.line}: {message}"}
        return False, {"id": line_id, "custom_id": self.custom_id, "line": self.line, "response": None, "error": error}
