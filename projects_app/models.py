"""Projects and their API keys (SPEC 10d): who a request is, what it owns, and its quotas.

A key belongs to a project; it is stored as its SHA-256 (a key is 32 random bytes: a slow hash
adds nothing) with a hint to recognise it, shown in full once. The keys of MILLM_API_KEYS form
the `default` project, as does every request while no key exists at all (the open server). An
admin project sees every project's objects, as the Django admin's staff do. Files, batches,
webhook endpoints, leases and probes record the project that made them (`project`), and
`OwnedQuerySet.owned_by` is the one filter every route reads them through.
"""

import hashlib
import secrets

from django.conf import settings
from django.db import models
from django.utils import timezone

from millm_lib.ids import new_id

DEFAULT_PROJECT = "default"
KEY_PREFIX = "mk_"
QUOTAS = {  # quota name: (the Project field that overrides it, the setting that gives its default)
    "active_batches": ("max_active_batches", "MILLM_QUOTA_ACTIVE_BATCHES"),
    "queued_rows": ("max_queued_rows", "MILLM_QUOTA_QUEUED_ROWS"),
    "file_bytes": ("max_file_bytes", "MILLM_QUOTA_FILE_BYTES"),
}


# Each app's reader of its stored bytes, which the `file_bytes` quota counts together: a reader
# takes project ids and answers {project id: bytes} (files_app's files, responses_app's responses).
stored_bytes_readers = []


def register_stored_bytes(reader):
    if reader not in stored_bytes_readers:
        stored_bytes_readers.append(reader)


def stored_bytes(project_ids):
    """{project id: the bytes every app stores for it} (the `file_bytes` quota's use)."""
    total = dict.fromkeys(project_ids, 0)
    for reader in stored_bytes_readers:
        for pk, size in reader(project_ids).items():
            total[pk] = total.get(pk, 0) + size
    return total


class ProjectQuerySet(models.QuerySet):
    def default(self):
        """The project of MILLM_API_KEYS' keys and of the open server."""
        return self.get_or_create(name=DEFAULT_PROJECT, defaults={"id": new_id("proj_")})[0]

    def named(self, name, admin=False):
        """The project called `name`, made (an admin project when `admin`) if missing."""
        return self.get_or_create(name=name, defaults={"id": new_id("proj_"), "is_admin": admin})[0]

    def calling(self, project_id):
        """The project a message web forwards to the engine names (its id), for the engine's
        ownership checks. None, which sees everything, only when it names none: the engine's
        own work."""
        from millm_lib.errors import ApiError

        if project_id is None:
            return None
        found = self.filter(pk=project_id).first()
        if found is None:  # deleted in the admin since the request was let in: it owns nothing
            raise ApiError(401, "invalid_api_key", "The project of the bearer key no longer exists")
        return found


class Project(models.Model):
    id = models.CharField(primary_key=True, max_length=40)
    name = models.CharField(max_length=128, unique=True)
    is_admin = models.BooleanField(default=False, help_text="Sees and acts on every project's objects.")
    max_active_batches = models.PositiveIntegerField(null=True, blank=True, help_text="Blank: MILLM_QUOTA_ACTIVE_BATCHES.")
    max_queued_rows = models.PositiveBigIntegerField(null=True, blank=True, help_text="Blank: MILLM_QUOTA_QUEUED_ROWS.")
    max_file_bytes = models.PositiveBigIntegerField(null=True, blank=True, help_text="Blank: MILLM_QUOTA_FILE_BYTES.")
    created_at = models.DateTimeField(default=timezone.now)

    objects = ProjectQuerySet.as_manager()

    def __str__(self):
        return self.name

    def limit(self, quota):
        """The project's limit for `quota` (one of QUOTAS), or None: no limit."""
        field, setting = QUOTAS[quota]
        own = getattr(self, field)
        return own if own is not None else getattr(settings, setting)

    def lock_for_quotas(self):
        """The project's row, locked until the caller's transaction ends, with its limits as they
        are now. Every create that checks a quota takes it before counting: two creates of one
        project then count each other's rows, where both would read the same use and both pass.
        FOR NO KEY UPDATE: it queues quota checks behind each other, but not the inserts of rows
        that merely reference the project (an engine recording a batch's output file)."""
        return Project.objects.select_for_update(no_key=True).get(pk=self.pk)


class OwnedQuerySet(models.QuerySet):
    """For models with a `project`: what a project may see (an admin project, or no project at
    all (the engine, the admin), sees everything)."""

    def owned_by(self, project):
        if project is None or project.is_admin:
            return self
        if project.name == DEFAULT_PROJECT:  # rows from before projects (or made without one) are its
            return self.filter(models.Q(project=project) | models.Q(project__isnull=True))
        return self.filter(project=project)


def _hash(key):
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyQuerySet(models.QuerySet):
    def active(self):
        return self.filter(revoked_at__isnull=True)

    def issue(self, project, name=""):
        """A new key for `project`: (the ApiKey, the key itself, which is never stored)."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        made = self.create(id=new_id("key_"), project=project, name=name, key_hash=_hash(key),
                           hint=f"{KEY_PREFIX}…{key[-4:]}")
        return made, key

    def project_of(self, key):
        """The project of an active key, or None: looked up by the key's hash (an index), so
        neither the lookup nor its time says anything about other keys."""
        found = self.active().select_related("project").filter(key_hash=_hash(key)).first()
        return found.project if found is not None else None


class ApiKey(models.Model):
    id = models.CharField(primary_key=True, max_length=40)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="keys")
    name = models.CharField(max_length=128, blank=True, default="")
    key_hash = models.CharField(max_length=64, unique=True)
    hint = models.CharField(max_length=16)
    created_at = models.DateTimeField(default=timezone.now)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        verbose_name = "API key"

    def __str__(self):
        return f"{self.hint} ({self.project})"

    def revoke(self):
        """Refused from the next request on (every route and socket looks the key up anew)."""
        return ApiKey.objects.filter(pk=self.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()) == 1


def quota_exceeded(project, quota, current, adding=0):
    """429 `quota_exceeded` when `current` use plus `adding` would pass the project's limit for
    `quota`; None when it fits (or the project has no limit)."""
    from millm_lib.errors import ApiError

    limit = project.limit(quota) if project is not None else None
    if limit is None or current + adding <= limit:
        return None
    field, setting = QUOTAS[quota]
    return ApiError(
        429, "quota_exceeded",
        f"Project {project.name!r} is over its {quota} quota: {current:,} in use{f' and {adding:,} more asked' if adding else ''}, "
        f"the limit is {limit:,} ({setting}, or the project's {field} in the admin); it frees as batches end and files go",
        details={"quota": quota, "limit": limit, "current": current},
    )
