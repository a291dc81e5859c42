"""Batches and their rows. PostgreSQL is the truth: every transition is a compare-and-set, and a
chunk's results and the batch's counts are written in one transaction fenced by the claim token."""

import json
import uuid

from django.db import connection, models, transaction
from django.db.models import F, Q
from django.utils import timezone

from files_app.models import File
from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from inference_app.models import Lease
from millm_lib.pagination import cursor_page



class FencedOut(Exception):
    """Another engine claimed the batch since we did: stop touching it."""


class BatchQuerySet(models.QuerySet):
    def unfinished(self):
        return self.filter(status__in=Batch.UNFINISHED)

    def page(self, after=None, limit=20):
        return cursor_page(self, after, limit)


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    class Waiting(models.TextChoices):
        QUEUED = "queued"
        MODEL_NOT_RESIDENT = "model_not_resident"
        LEASE_UNAVAILABLE = "lease_unavailable"
        WEIGHTS_TORN = "weights_torn"

    UNFINISHED = [Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING]

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
    output_tokens = models.BigIntegerField(default=0)
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)
    pack = models.BooleanField(default=False)
    pack_window = models.IntegerField(default=0)
    batched_decoding = models.BooleanField(default=False)
    output_expires_after = models.IntegerField(null=True, blank=True)
    lease = models.ForeignKey(Lease, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    lease_mode = models.CharField(max_length=8, null=True, blank=True)  # own | caller
    waiting_reason = models.CharField(max_length=24, choices=Waiting.choices, null=True, blank=True)
    claimed_by = models.CharField(max_length=40, null=True, blank=True)
    claim_token = models.UUIDField(null=True, blank=True)
    # The end a cancel, an expiry or a failure asked for; finalization stamps it.
    end_status = models.CharField(max_length=16, null=True, blank=True)

    objects = BatchQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "batches"
        indexes = [models.Index(fields=["status", "created_at"])]

    def __str__(self):
        return f"batch {self.id} ({self.status})"

    @property
    def holder(self):
        return f"millm-batch:{self.id}"

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

    def hand_lease(self, header):
        """POST .../lease: run under the caller's live lease from now on; our own is released."""
        from inference_app.leases import LEASE_HEADER, lease_expired, presented_lease

        if not header:
            raise ApiError(400, "invalid_lease_request", f"Send the lease to hand over in {LEASE_HEADER}", param=LEASE_HEADER)
        lease = presented_lease(header)
        if not lease.live:
            raise lease_expired(lease)
        if self.model and lease.model_id != self.model:
            raise ApiError(
                409, "batch_state_conflict",
                f"The lease is on '{lease.model_id}', but the batch runs '{self.model}'",
                param=LEASE_HEADER,
            )
        previous = self.lease_id if self.lease_mode == "own" else None
        updated = Batch.objects.filter(pk=self.pk, status__in=self.UNFINISHED).update(lease=lease, lease_mode="caller")
        if updated != 1:
            self.refresh_from_db()
            raise ApiError(
                409, "batch_state_conflict",
                f"The batch '{self.id}' is {self.status}; a lease is handed only to an unfinished batch",
                param="batch_id",
            )
        if previous:
            Lease.objects.end_all("handed over to the caller's lease", pk=previous)
        self.refresh_from_db()
        return self

    def to_openai(self):
        def stamp(value):
            return int(value.timestamp()) if value else None

        errors = None
        if self.errors:
            errors = {"object": "list", "data": self.errors[:100]}
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": stamp(self.created_at),
            "in_progress_at": stamp(self.in_progress_at),
            "expires_at": stamp(self.expires_at),
            "finalizing_at": stamp(self.finalizing_at),
            "completed_at": stamp(self.completed_at),
            "failed_at": stamp(self.failed_at),
            "expired_at": stamp(self.expired_at),
            "cancelling_at": stamp(self.cancelling_at),
            "cancelled_at": stamp(self.cancelled_at),
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": self.metadata,
            "usage": {
                "input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens,
            },
            "millm": {
                "pack": self.pack,
                "pack_window": self.pack_window,
                "batched_decoding": self.batched_decoding,
                "waiting_reason": self.waiting_reason if self.status == self.Status.IN_PROGRESS else None,
                "lease_mode": self.lease_mode,
                "output_expires_after": self.output_expires_after,
            },
        }

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

    def set_waiting(self, reason):
        if self.waiting_reason != reason:
            Batch.objects.filter(pk=self.pk, claim_token=self.claim_token).update(waiting_reason=reason)
            self.waiting_reason = reason
            return True
        return False

    def record_chunk(self, results, chunk):
        """Write a chunk's results and the batch's counts in one transaction, fenced.

        `results`: [(row, outcome, response, error, request_id, packed, headers, usage)].
        One UPDATE writes every row, and only rows still pending: a recorded row is never written
        again (if one was, the whole chunk is refused and rolled back).
        """
        with transaction.atomic():
            self.fenced()
            now = timezone.now()
            written = BatchRow.objects.record(
                [(row.pk, outcome, response, error, request_id, packed, headers)
                 for row, outcome, response, error, request_id, packed, headers, _ in results],
                chunk, now,
            )
            if written != {row.pk for row, *_ in results}:
                line = min(row.line for row, *_ in results if row.pk not in written)
                raise FencedOut(f"row {line} of {self.pk} was already recorded")
            succeeded = [usage for _, outcome, *_, usage in results if outcome == BatchRow.Outcome.SUCCEEDED]
            Batch.objects.filter(pk=self.pk).update(
                completed=F("completed") + len(succeeded),
                failed=F("failed") + len(results) - len(succeeded),
                input_tokens=F("input_tokens") + sum(usage.get("prompt_tokens", 0) for usage in succeeded),
                output_tokens=F("output_tokens") + sum(usage.get("completion_tokens", 0) for usage in succeeded),
                waiting_reason=None,
            )
        self.refresh_from_db(fields=["completed", "failed", "input_tokens", "output_tokens", "waiting_reason", "status"])


class BatchRowQuerySet(models.QuerySet):
    def unrecorded(self):
        return self.filter(outcome=BatchRow.Outcome.PENDING).order_by("line")

    def record(self, results, chunk, recorded_at):
        """One UPDATE for a chunk's rows, each written only while still pending; returns the ids
        it wrote. `results`: [(id, outcome, response, error, request_id, packed, headers)]."""
        if not results:
            return set()
        table = BatchRow._meta.db_table
        values = ", ".join(["(%s::bigint, %s, %s::jsonb, %s::jsonb, %s, %s::boolean, %s::boolean, %s::jsonb)"] * len(results))
        params = []
        for pk, outcome, response, error, request_id, packed, headers in results:
            # A row that shared its decode steps says so in its header (SPEC 8a) and its column.
            batched = (headers or {}).get("X-miLLM-Backend") == "batched"
            params += [pk, outcome, _jsonb(response), _jsonb(error), request_id, packed, batched, _jsonb(headers)]
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} AS r SET outcome = v.outcome, response = v.response, error = v.error, "
                f"request_id = v.request_id, packed = v.packed, batched = v.batched, headers = v.headers, chunk = %s, "
                f"recorded_at = %s FROM (VALUES {values}) AS v(id, outcome, response, error, request_id, packed, batched, headers) "
                f"WHERE r.id = v.id AND r.outcome = %s RETURNING r.id",
                [chunk, recorded_at, *params, BatchRow.Outcome.PENDING],
            )
            return {row[0] for row in cursor.fetchall()}


def _jsonb(value):
    """A JSONField value as the UPDATE's parameter: None is SQL NULL, as Django stores it."""
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
    response = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    packed = models.BooleanField(default=False)
    batched = models.BooleanField(default=False)  # its sequence shared decode steps with others
    headers = models.JSONField(null=True, blank=True)
    chunk = models.IntegerField(null=True, blank=True)
    recorded_at = models.DateTimeField(null=True, blank=True)

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
        indexes = [models.Index(fields=["batch", "outcome", "line"])]

    def __str__(self):
        return f"line {self.line} of {self.batch_id}"

    def output_line(self, unrun_code=None):
        """(is_output, the JSONL object) for the output or the error file."""
        line_id = new_id("batch_req_")
        if self.outcome == self.Outcome.SUCCEEDED:
            response = {"status_code": 200, "request_id": self.request_id, "body": self.response,
                        "millm": {"packed": self.packed, "batched": self.batched, "headers": self.headers or {}}}
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
