"""Files: batch inputs and outputs. The record lives in PostgreSQL, the bytes in django-storages."""

import errno
import logging
from datetime import timedelta

from django.core.exceptions import SuspiciousOperation
from django.core.files.storage import storages
from django.db import IntegrityError, models, transaction
from django.db.models import Q, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from files_app.shapes import FileObject
from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from projects_app.models import OwnedQuerySet, quota_exceeded, stored_bytes
from millm_lib.pagination import cursor_page

log = logging.getLogger(__name__)

IDEMPOTENCY_WINDOW = timedelta(hours=24)


def file_storage():
    return storages["default"]


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_RETRY_AFTER_S = 30


def disk_full(error):
    """The refusal for an OSError of a full disk (or quota), else None: 507 insufficient_storage
    (WebDAV's status for "the server cannot store the representation"), with Retry-After."""
    if not isinstance(error, OSError) or error.errno not in DISK_FULL:
        return None
    return ApiError(
        507, "insufficient_storage",
        "The server's file storage is full (no space left on the disk that holds MILLM_DATA_DIR); "
        "nothing was stored. Retry once space is freed.",
        retry_after=DISK_FULL_RETRY_AFTER_S,
    )


class FileQuerySet(OwnedQuerySet):
    def visible(self):
        """Every file but deleted ones: those are 404 everywhere and never listed."""
        return self.exclude(status=File.Status.DELETED)

    def expiring(self, now):
        return self.filter(status=File.Status.PROCESSED, expires_at__lte=now)

    def page(self, after=None, limit=20, order="desc"):
        return cursor_page(self, after, limit, order)

    def stored(self):
        """Files whose bytes count against their project's file_bytes quota: processed and not
        past expires_at (an expired file frees its share at once, before the pruner removes it)."""
        unexpired = Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
        return self.filter(unexpired, status=File.Status.PROCESSED)

    def stored_bytes(self):
        return self.stored().aggregate(total=FILE_QUOTA_USE)["total"]


# The file_bytes quota's use, as an aggregate: over one project's files, or grouped by project.
FILE_QUOTA_USE = Coalesce(Sum("bytes"), 0)


def over_file_quota(project, adding):
    """429 quota_exceeded when `adding` more bytes would pass `project`'s file_bytes quota (every
    app's stored bytes: files, stored responses), else None."""
    if project is None or project.limit("file_bytes") is None:
        return None
    return quota_exceeded(project, "file_bytes", stored_bytes([project.pk])[project.pk], adding)


def files_stored_bytes(project_ids):
    """{project id: its stored files' bytes}: files_app's reader of the file_bytes quota."""
    files = File.objects.stored().filter(project__in=project_ids).order_by().values_list("project")
    return dict(files.annotate(stored=FILE_QUOTA_USE))


class File(models.Model):
    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    class Status(models.TextChoices):
        PROCESSED = "processed"
        ERROR = "error"
        EXPIRED = "expired"
        DELETED = "deleted"

    id = models.CharField(primary_key=True, max_length=40)
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    filename = models.CharField(max_length=512)
    bytes = models.BigIntegerField()
    line_count = models.IntegerField()
    storage_name = models.CharField(max_length=512)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PROCESSED)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    project = models.ForeignKey("projects_app.Project", null=True, blank=True, on_delete=models.PROTECT,
                                related_name="+", help_text="The project that made it (SPEC 10d).")

    objects = FileQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["created_at", "id"]), models.Index(fields=["status", "expires_at"])]

    def __str__(self):
        return f"{self.id} ({self.filename})"

    @classmethod
    def record(cls, upload, purpose, expires_after_seconds, idempotency_key=None, filename=None, project=None):
        """Store a completed upload's bytes under their final name, then record it for `project`.

        1. Over the project's file_bytes quota by the measured size: refused, nothing stored.
        2. The bytes are saved (a crash after that leaves an orphan the sweep removes, never a
           record without bytes).
        3. In one transaction: the project locked and its quota counted again (a racing upload
           of the same project has committed or waits), the record and its idempotency key.
           Over the quota now, the bytes are deleted and no record is written.
        Returns (file, created).
        """
        refusal = over_file_quota(project, upload.size)
        if refusal is not None:
            raise refusal
        file = cls.store_bytes(upload, purpose, expires_after_seconds, filename, project)
        try:
            with transaction.atomic():
                if project is not None:
                    refusal = over_file_quota(project.lock_for_quotas(), file.bytes)
                    if refusal is not None:
                        raise refusal
                file.save(force_insert=True)
                if idempotency_key:
                    IdempotencyKey.objects.create(scope="file", key=idempotency_key, object_id=file.id, project=project)
        except IntegrityError:
            # Another upload with the same Idempotency-Key won the race: answer its file.
            file_storage().delete(file.storage_name)
            existing = IdempotencyKey.lookup("file", idempotency_key, project)
            if existing is None:
                raise
            return cls.objects.get(pk=existing), False
        except ApiError:
            file_storage().delete(file.storage_name)
            raise
        return file, True

    @classmethod
    def store_bytes(cls, upload, purpose, expires_after_seconds, filename=None, project=None):
        """Step one of recording: the bytes saved under their final name, and the unsaved
        record that will own them, `project`'s (the caller saves it in its own transaction)."""
        file_id = new_id("file-")
        name = f"files/{file_id}.jsonl"
        try:
            stored = file_storage().save(name, upload)
        except BaseException:
            # A failed save (a full disk) may leave a partial file under the final name: it is
            # never recorded, so never served; remove it now rather than at the orphan sweep.
            try:
                file_storage().delete(name)
            except Exception:
                log.warning("could not remove the partial bytes %s; the orphan sweep will", name, exc_info=True)
            raise
        now = timezone.now()
        return cls(
            id=file_id,
            purpose=purpose,
            filename=filename or upload.name,
            bytes=upload.size,
            line_count=upload.line_count,
            storage_name=stored,
            created_at=now,
            expires_at=now + timedelta(seconds=expires_after_seconds),
            project=project,
        )

    def record_stored(self):
        """Step two of `store_bytes`: the record of the saved bytes, in the caller's transaction."""
        self.save(force_insert=True)

    @property
    def is_expired(self):
        return self.status == self.Status.EXPIRED or (
            self.expires_at is not None and self.expires_at <= timezone.now()
        )

    def to_openai(self):
        details = None
        if self.is_expired:
            when = self.expired_at or self.expires_at
            details = f"expired at {when.strftime('%Y-%m-%dT%H:%M:%SZ')}; its content is gone"
        return FileObject(
            id=self.id,
            object="file",
            bytes=self.bytes,
            created_at=int(self.created_at.timestamp()),
            expires_at=int(self.expires_at.timestamp()) if self.expires_at else None,
            filename=self.filename,
            purpose=self.purpose,
            # The SDK knows uploaded|processed|error; expiry is said in status_details.
            status="error" if self.status == self.Status.ERROR else "processed",
            status_details=details,
        )

    def open_content(self):
        """The bytes, or 404 file_expired for an expired file (its record stays)."""
        if self.is_expired:
            raise ApiError(404, "file_expired", f"The file '{self.id}' expired; its content is gone", param="file_id")
        try:
            return file_storage().open(self.storage_name, "rb")
        except (SuspiciousOperation, FileNotFoundError) as error:
            # A storage name outside storage (the storage refuses it: the filesystem with
            # SuspiciousFileOperation, S3 with its parent SuspiciousOperation) or bytes that are gone.
            log.error("the content of %s cannot be opened from storage: %r", self.pk, error)
            raise ApiError(404, "file_not_found", f"The content of the file '{self.id}' is not in storage",
                           param="file_id") from None

    def unfinished_user(self):
        """An unfinished object that still needs these bytes, found through the reverse
        relations (batches point here), or None. files_app never imports batches_app."""
        for relation in self._meta.related_objects:
            related = relation.related_model
            if not hasattr(related.objects, "unfinished"):
                continue
            user = related.objects.unfinished().filter(**{relation.field.name: self}).first()
            if user is not None:
                return user
        return None

    def delete_bytes(self, status, stamp_field):
        """Remove the bytes, keep the record (compare-and-set on its current status)."""
        now = timezone.now()
        updated = File.objects.filter(pk=self.pk, status=self.status).update(status=status, **{stamp_field: now})
        if updated != 1:
            return False  # someone else expired or deleted it first
        try:
            file_storage().delete(self.storage_name)
        except OSError:
            log.warning("could not remove the bytes of %s; the orphan sweep will", self.pk, exc_info=True)
        self.status = status
        setattr(self, stamp_field, now)
        return True

    def remove(self):
        """DELETE /v1/files/{id}: refused while an unfinished batch needs the file.

        The file's row is locked while we look, and a batch create locks it too, so a delete
        and a create on the same file cannot both go through.
        """
        with transaction.atomic():
            File.objects.select_for_update().filter(pk=self.pk).first()
            user = self.unfinished_user()
            if user is not None:
                raise ApiError(
                    409,
                    "file_in_use",
                    f"The file '{self.id}' is needed by {user} until it ends; cancel it or wait",
                    param="file_id",
                )
            self.delete_bytes(self.Status.DELETED, "deleted_at")


class IdempotencyKey(models.Model):
    """`Idempotency-Key` on POST /v1/files and /v1/batches: the same key answers the first
    object again for 24 hours. Keys are per project: another project's use of the same key
    neither answers its object nor refuses ours."""

    scope = models.CharField(max_length=16)
    key = models.CharField(max_length=255)
    object_id = models.CharField(max_length=40)
    created_at = models.DateTimeField(default=timezone.now)
    project = models.ForeignKey("projects_app.Project", null=True, blank=True, on_delete=models.CASCADE,
                                related_name="+")

    class Meta:
        constraints = [
            # Two partial constraints, not one with NULLS NOT DISTINCT (PostgreSQL 15 and later only).
            models.UniqueConstraint(fields=["scope", "project", "key"], condition=Q(project__isnull=False),
                                    name="one_object_per_project_idempotency_key"),
            models.UniqueConstraint(fields=["scope", "key"], condition=Q(project__isnull=True),
                                    name="one_object_per_idempotency_key"),
        ]

    @classmethod
    def lookup(cls, scope, key, project=None):
        if not key:
            return None
        limit = cls._meta.get_field("key").max_length
        if len(key) > limit:
            raise ApiError(400, "invalid_parameter", f"Invalid value for 'Idempotency-Key': at most {limit} characters, "
                           f"got {len(key):,}", param="Idempotency-Key")
        mine = cls.objects.filter(scope=scope, key=key, project=project)
        mine.filter(created_at__lt=timezone.now() - IDEMPOTENCY_WINDOW).delete()
        found = mine.first()
        return found.object_id if found else None
