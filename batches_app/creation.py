"""POST /v1/batches: every create check of SPEC 10, each refusal naming its field: the body by its
model (`shapes.BatchCreate`), then the input file, the lease and the quotas (they read the
database)."""

from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from batches_app import leasing
from batches_app.models import Batch
from batches_app.shapes import BatchCreate
from files_app.models import File, IdempotencyKey
from millm_lib.bodies import validate_body
from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from millm_lib.limits import PROBE_SCORE

CODE = "invalid_batch_request"


def refuse(message, param, code=CODE, status=400):
    return ApiError(status, code, message, param=param)


def create_batch(body, lease_header=None, idempotency_key=None, project=None):
    """The new batch of `project` (None: of no project, and under no quota)."""
    if not isinstance(body, dict):
        raise refuse("The body must be a JSON object", None)
    existing = IdempotencyKey.lookup("batch", idempotency_key, project)
    if existing is not None:
        return Batch.objects.get(pk=existing)
    request = validate_body(BatchCreate, body, CODE)
    pack = _default(request.pack, settings.BATCH_PACK_DEFAULT)
    batched_decoding = _default(request.batched_decoding, settings.BATCH_DECODING_DEFAULT)
    if request.prefix_reuse:
        _check_prefix_reuse(request.endpoint, pack, batched_decoding)
    input_file = _input_file(request.input_file_id, project)
    lease = leasing.lease_for_new_batch(lease_header, input_file, request.endpoint, project)
    now = timezone.now()
    batch = Batch(
        id=new_id("batch_"), endpoint=request.endpoint, input_file=input_file,
        completion_window=request.completion_window, created_at=now,
        expires_at=now + timedelta(hours=int(request.completion_window[:-1])), metadata=request.metadata,
        output_expires_after=request.output_expires_after.seconds if request.output_expires_after else None,
        pack=pack,
        pack_window=_default(request.pack_window, settings.BATCH_PACK_WINDOW_DEFAULT),
        batched_decoding=batched_decoding, prefix_reuse=bool(request.prefix_reuse),
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


def _check_prefix_reuse(endpoint, pack, batched_decoding):
    """Reuse runs a shared prefix once and each row after it: rows that run in packs (`pack`) or
    in seats (`batched_decoding`). A row run alone keeps its promise of equalling the synchronous
    answer bit for bit, so reuse without either is refused, as on a probe batch, whose rows
    always run alone, and where the engines hold no prefix (MILLM_PREFIX_CACHE_MB=0)."""
    if endpoint == PROBE_SCORE:
        raise refuse(f"prefix_reuse does not apply to {PROBE_SCORE}: its rows always run alone", "prefix_reuse")
    if not (pack or batched_decoding):
        raise refuse("prefix_reuse needs pack: true (scoring and embedding rows) or batched_decoding: true "
                     "(generation rows): a row run alone equals the synchronous answer bit for bit, and reuse "
                     "would break that", "prefix_reuse")
    if settings.MILLM_PREFIX_CACHE_MB == 0:
        raise refuse("prefix_reuse needs a prefix cache, and MILLM_PREFIX_CACHE_MB is 0", "prefix_reuse")


def _default(value, default):
    return default if value is None else value


def _input_file(file_id, project):
    """The caller's batch file `file_id` (the body model checked it is a non-empty string)."""
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
