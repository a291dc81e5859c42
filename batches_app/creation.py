"""POST /v1/batches: every create check of SPEC 10, in order, each refusal naming its field."""

import json
import re
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from batches_app import leasing
from batches_app.models import Batch
from files_app.models import File, IdempotencyKey
from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from millm_lib.limits import BATCH_ENDPOINTS, EXPIRES_AFTER_MAX_S, EXPIRES_AFTER_MIN_S

WINDOW = re.compile(r"^([1-9][0-9]{0,3})h$")
KNOWN = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after", "pack", "pack_window", "batched_decoding"}


def refuse(message, param, code="invalid_batch_request", status=400):
    return ApiError(status, code, message, param=param)


def create_batch(body, lease_header=None, idempotency_key=None, project=None):
    """The new batch of `project` (None: of no project, and under no quota)."""
    if not isinstance(body, dict):
        raise refuse("The body must be a JSON object", None)
    existing = IdempotencyKey.lookup("batch", idempotency_key, project)
    if existing is not None:
        return Batch.objects.get(pk=existing)
    unknown = [key for key in body if key not in KNOWN]
    if unknown:
        raise refuse(f"Unknown field '{unknown[0]}'; a batch takes {', '.join(sorted(KNOWN))}", unknown[0])
    input_file = _input_file(body.get("input_file_id"), project)
    endpoint = body.get("endpoint")
    if endpoint not in BATCH_ENDPOINTS:
        raise refuse(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}", "endpoint")
    window_hours = _window(body.get("completion_window"))
    metadata = _metadata(body.get("metadata"))
    output_expiry = _output_expiry(body.get("output_expires_after"))
    pack = body.get("pack", settings.BATCH_PACK_DEFAULT)
    if pack is None:
        pack = settings.BATCH_PACK_DEFAULT
    if not isinstance(pack, bool):
        raise refuse(f"pack must be true or false, got {pack!r}", "pack")
    pack_window = body.get("pack_window", settings.BATCH_PACK_WINDOW_DEFAULT)
    if pack_window is None:
        pack_window = settings.BATCH_PACK_WINDOW_DEFAULT
    if isinstance(pack_window, bool) or not isinstance(pack_window, int) or not 0 <= pack_window <= settings.BATCH_PACK_WINDOW_MAX:
        raise refuse(f"pack_window must be a whole number from 0 to {settings.BATCH_PACK_WINDOW_MAX} (BATCH_PACK_WINDOW_MAX), got {pack_window!r}", "pack_window")
    batched_decoding = body.get("batched_decoding", settings.BATCH_DECODING_DEFAULT)
    if batched_decoding is None:
        batched_decoding = settings.BATCH_DECODING_DEFAULT
    if not isinstance(batched_decoding, bool):
        raise refuse(f"batched_decoding must be true or false, got {batched_decoding!r}", "batched_decoding")
    lease = leasing.lease_for_new_batch(lease_header, input_file, endpoint, project)
    now = timezone.now()
    batch = Batch(
        id=new_id("batch_"), endpoint=endpoint, input_file=input_file, completion_window=body["completion_window"],
        created_at=now, expires_at=now + timedelta(hours=window_hours), metadata=metadata,
        output_expires_after=output_expiry, pack=pack, pack_window=pack_window,
        batched_decoding=batched_decoding,
        lease=lease, lease_mode=leasing.CALLER if lease else None, project=project,
    )
    try:
        batch.insert(idempotency_key, recheck_input=lambda file_id: _input_file(file_id, project))
    except IntegrityError:
        existing = IdempotencyKey.lookup("batch", idempotency_key, project)
        if existing is None:
            raise
        return Batch.objects.get(pk=existing)
    return batch


def _input_file(file_id, project):
    if not isinstance(file_id, str) or not file_id:
        got = "" if file_id is None else f", got {json.dumps(file_id)[:80]}"
        raise refuse(f"input_file_id is required: the id of a file uploaded with purpose batch{got}", "input_file_id")
    # A batch uses only its own project's files: another's answers exactly as an unknown id.
    file = File.objects.owned_by(project).filter(pk=file_id).first()
    if file is None:
        raise refuse(f"No file has the id '{file_id}'", "input_file_id", "file_not_found", 404)
    if file.status == File.Status.DELETED:
        raise refuse(f"The file '{file_id}' was deleted", "input_file_id", "file_deleted", 404)
    if file.purpose != File.Purpose.BATCH:
        raise refuse(f"The file '{file_id}' has purpose {file.purpose}; a batch needs purpose batch", "input_file_id")
    if file.is_expired:
        raise refuse(f"The file '{file_id}' has expired", "input_file_id", "file_expired", 404)
    return file


def _window(value):
    match = WINDOW.match(value) if isinstance(value, str) else None
    hours = int(match.group(1)) if match else 0
    limit = settings.BATCH_MAX_COMPLETION_WINDOW_HOURS
    if not 1 <= hours <= limit:
        raise refuse(f"completion_window must be '24h' or whole hours from '1h' to '{limit}h', got {value!r}", "completion_window")
    return hours


def _metadata(value):
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16:
        raise refuse("metadata must be an object of at most 16 string pairs", "metadata")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise refuse(f"metadata['{key[:64]}']: keys are at most 64 characters and values strings of at most 512", "metadata")
    return value


def _output_expiry(value):
    if value is None:
        return None
    low, high = EXPIRES_AFTER_MIN_S, EXPIRES_AFTER_MAX_S
    if not isinstance(value, dict) or value.get("anchor") != "created_at":
        raise refuse('output_expires_after must be {"anchor": "created_at", "seconds": N}', "output_expires_after.anchor")
    seconds = value.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not low <= seconds <= high:
        raise refuse(f"output_expires_after.seconds must be from {low:,} to {high:,}, got {seconds!r}", "output_expires_after.seconds")
    return seconds
