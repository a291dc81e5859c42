"""Retention: expire files past `expires_at`, and sweep bytes no record owns.

`prune_files()` runs at engine start-up and every BATCH_RETENTION_INTERVAL_S, and as
`python manage.py prune` (through batches_app.retention, which prunes ended batches too). A
file an unfinished batch references is never pruned.
"""

import logging
import time
from datetime import timedelta

from django.utils import timezone

from files_app.models import File, file_storage

log = logging.getLogger(__name__)

# inference_app.weight_uploads.PREFIX: files_app does not import inference_app.
WEIGHT_UPLOADS = "weights-uploads"
# Bytes younger than this may belong to an upload that is being recorded right now.
ORPHAN_GRACE = timedelta(hours=1)


def prune_files(now=None):
    """Expire every file past its `expires_at` that nothing unfinished needs; returns their ids."""
    now = now or timezone.now()
    expired = []
    for file in File.objects.expiring(now).iterator():
        if file.unfinished_user() is not None:
            continue
        if file.delete_bytes(File.Status.EXPIRED, "expired_at"):
            expired.append(file.pk)
    if expired:
        log.info("expired %d file(s): %s", len(expired), ", ".join(expired[:10]))
    return expired


def sweep_orphans(now=None):
    """Remove stored bytes that no live record names (a crash between save and record), and
    weights PUT bodies a crash left behind (web deletes them once the engine has answered)."""
    now = now or timezone.now()
    owned = set(
        File.objects.filter(status__in=[File.Status.PROCESSED, File.Status.ERROR]).values_list("storage_name", flat=True)
    )
    removed = []
    for folder in ("files", WEIGHT_UPLOADS):
        removed.extend(_sweep_folder(folder, owned, now))
    if removed:
        log.info("swept %d orphaned file(s)", len(removed))
    return removed


def _sweep_folder(folder, owned, now):
    storage = file_storage()
    try:
        _, names = storage.listdir(folder)
    except (FileNotFoundError, NotImplementedError):
        return []
    removed = []
    for name in names:
        path = f"{folder}/{name}"
        if path in owned:
            continue
        try:
            modified = storage.get_modified_time(path)
        except (OSError, NotImplementedError):
            continue
        if now - modified < ORPHAN_GRACE:
            continue
        storage.delete(path)
        removed.append(path)
    return removed


def run_retention():
    started = time.monotonic()
    expired = prune_files()
    swept = sweep_orphans()
    return {"expired": expired, "swept": swept, "seconds": round(time.monotonic() - started, 3)}
