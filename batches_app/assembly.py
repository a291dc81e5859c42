"""Finalization: the output and error files, streamed in input order, written then recorded."""

import json
import logging
import os
import tempfile

from django.conf import settings
from django.core.files import File as DjangoFile

from batches_app.models import Batch, BatchRow, FencedOut
from files_app.models import File, file_storage

log = logging.getLogger("millm.batches")


class _Spool:
    """A temporary JSONL file on disk, counted as it is written."""

    def __init__(self, name):
        self.name = name
        self.handle = tempfile.NamedTemporaryFile("w+b", dir=settings.FILE_UPLOAD_TEMP_DIR, delete=False, suffix=".jsonl")
        self.lines = 0

    def write(self, obj):
        self.handle.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
        self.lines += 1

    def store(self, expires_after_seconds, project):
        """The bytes saved; the unsaved File that will own them, `project`'s (saved with the
        batch's end)."""
        self.handle.flush()
        self.handle.seek(0)
        upload = DjangoFile(self.handle, name=self.name)
        upload.line_count = self.lines
        return File.store_bytes(upload, File.Purpose.BATCH_OUTPUT, expires_after_seconds, filename=self.name,
                                project=project)

    def discard(self):
        try:
            self.handle.close()
        except OSError:
            pass  # the flush on close failed (a full disk): the file is removed all the same
        try:
            os.unlink(self.handle.name)
        except FileNotFoundError:
            pass


def assemble(batch):
    """1. Write every line, in input order, to the output or the error file (on disk).
    2. Save both files' bytes under their final names.
    3. In one transaction, fenced: record the files, attach them, stamp the end status,
       delete the row bodies.
    4. Release the batch's own lease.

    A batch that failed at validation (it never reached in_progress) writes only its invalid
    lines; any other writes each input line exactly once across the two files.
    """
    if batch.status not in Batch.UNFINISHED:
        return batch  # assembled already: its files are recorded, nothing is written twice
    if batch.end_status:
        end = batch.end_status
    elif batch.status == Batch.Status.CANCELLING:
        end = Batch.Status.CANCELLED
    else:
        end = Batch.Status.COMPLETED
    batch.end_status = end
    reached_progress = batch.in_progress_at is not None
    # A failure anywhere here (a full disk, the database gone) raises: the batch stays
    # finalizing, its claim is released and assembly runs again; nothing half-written is stored.
    spools, stored = [], []
    try:
        output = _Spool(f"{batch.id}_output.jsonl")
        spools.append(output)
        errors = _Spool(f"{batch.id}_error.jsonl")
        spools.append(errors)
        for row in batch.rows.order_by("line").iterator(chunk_size=2000):
            if row.outcome == BatchRow.Outcome.PENDING and not reached_progress:
                continue
            is_output, line = row.output_line(batch.unrun_code or "batch_failed")
            (output if is_output else errors).write(line)
        expires = batch.output_expires_after or settings.BATCH_FILE_RETENTION_DAYS * 86_400
        # The batch's files are its project's (they count against its file_bytes quota).
        output_file = output.store(expires, batch.project) if reached_progress else None
        stored.append(output_file)
        error_file = errors.store(expires, batch.project) if errors.lines else None
        stored.append(error_file)
    except BaseException:
        _remove_bytes(stored)  # the output's bytes, when the error file's could not be saved
        raise
    finally:
        for spool in spools:
            spool.discard()
    try:
        end = batch.finish(end, output_file, error_file)
    except FencedOut:
        _remove_bytes(stored)  # certainly not recorded: another engine owns the batch now
        raise
    if end is None:
        _remove_bytes(stored)  # ended while we wrote (never by our own runner): the first files stand
        batch.refresh_from_db()
        return batch
    batch.refresh_from_db()
    log.info("batch %s %s: %d completed, %d failed", batch.pk, end, batch.completed, batch.failed)
    return batch


def _remove_bytes(files):
    for file in files:
        if file is None:
            continue
        try:
            file_storage().delete(file.storage_name)
        except Exception:
            log.warning("could not remove the unrecorded bytes %s; the orphan sweep will", file.storage_name, exc_info=True)
