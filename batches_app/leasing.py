"""Which lease a batch runs under (SPEC 6 and 10), in one place.

A batch runs under its caller's live lease (`caller`: presented at create, or handed over later
through POST /v1/batches/{id}/lease), or under its own (`own`), which the runner acquires in the
name `millm-batch:<id>`, renews while the batch runs and releases when it ends. The server's own
batch leases never block a batch create nor another batch (batches queue, they do not block each
other); an outside holder's live lease does.
"""

import json

from django.utils import timezone

from batches_app import lifecycle
from inference_app.catalogue import resolve
from inference_app.leases import LEASE_HEADER, lease_expired, model_leased, presented_lease
from inference_app.models import Engine, Lease
from millm_lib.errors import ApiError
from millm_lib.limits import PROBE_SCORE

OWN = "own"
CALLER = "caller"
HOLDER_PREFIX = "millm-batch:"


def holder_of(batch_id):
    return f"{HOLDER_PREFIX}{batch_id}"


def is_batch_lease(lease):
    return lease.holder.startswith(HOLDER_PREFIX)


def lease_for_new_batch(header, input_file, endpoint, project=None):
    """A presented lease, one of the caller's `project`: unknown (or another project's) 404,
    ended 409. Not presented: an outside holder's live lease
    on the batch's model blocks the create (409); the server's own batch leases never do, nor a
    lease on another model (two engines, two models: a lease on one never refuses the other's
    batches). The batch's model is the one its input file's first lines name; where they name
    none (a probe-score batch scores on whatever is resident), any outside lease blocks, and
    validation decides again with every line."""
    presented = presented_lease(header, project)
    if presented is not None:
        if not presented.live:
            raise lease_expired(presented)
        return presented
    outside = Lease.objects.live().exclude(holder__startswith=HOLDER_PREFIX)
    if not outside.exists():
        return None  # the usual case: no file read
    model = None if endpoint == PROBE_SCORE else named_model(input_file)
    blocking = outside.filter(model_id=model).first() if model else outside.first()
    if blocking is not None:
        raise model_leased(blocking, "a batch")
    return None


def named_model(input_file, lines=100):
    """The catalogue id the first of the file's first `lines` lines that names a model resolves
    to (an unknown name as written), or None: a hint for the create-time check only."""
    with input_file.open_content() as handle:
        for _, raw in zip(range(lines), handle):
            try:
                model = json.loads(raw).get("body", {}).get("model")
            except (ValueError, AttributeError):
                continue
            if isinstance(model, str) and model:
                try:
                    return resolve(model).pk
                except ApiError:
                    return model
    return None


def lease_to_hand_over(batch, header, project):
    """POST .../lease: the caller's live lease (one of its `project`'s), on the batch's model, or
    the refusal."""
    if not header:
        raise ApiError(400, "invalid_lease_request", f"Send the lease to hand over in {LEASE_HEADER}", param=LEASE_HEADER)
    lease = presented_lease(header, project)
    if not lease.live:
        raise lease_expired(lease)
    if batch.model and lease.model_id != batch.model:
        raise ApiError(
            409, "batch_state_conflict",
            f"The lease is on '{lease.model_id}', but the batch runs '{batch.model}'",
            param=LEASE_HEADER,
        )
    return lease


def blocking_lease(batch, model_id):
    """The live lease that fails the batch at validation: an outside holder's on its model. A
    batch's own lease and the one the batch was given never block it."""
    lease = Lease.objects.on_model(model_id)
    if lease is not None and not is_batch_lease(lease) and lease.pk != batch.lease_id:
        return lease
    return None


def hold(batch, engine_id, ttl_seconds):
    """Before each chunk: True when the batch runs under its caller's live lease, or its own
    (acquired, renewed after a third of its TTL); False when an outside holder's live lease
    makes it wait."""
    lease = Lease.objects.filter(pk=batch.lease_id).first() if batch.lease_id else None
    if lease is not None and lease.live and lease.model_id == batch.model:
        if (timezone.now() - lease.renewed_at).total_seconds() > lease.ttl_seconds / 3:
            lease.renew()
        return True
    live = Lease.objects.on_model(batch.model)
    if live is not None and is_batch_lease(live) and not led_by_a_running_engine(live, type(batch).objects):
        # Left by a batch that ended without releasing (a crash): batches queue, they do
        # not block each other.
        Lease.objects.end_all("superseded by another batch", pk=live.pk)
        live = None
    if live is not None:
        return False
    engine = Engine.objects.get(pk=engine_id)
    held, lease_id = Lease.acquire(engine, batch.model, batch.holder, f"batch {batch.pk}", ttl_seconds, project=batch.project)
    if lease_id is None:
        return False
    batch.take_own_lease(held)
    return True


def led_by_a_running_engine(lease, batches):
    """The batch a batch lease was taken for is unfinished and claimed by a running engine
    (another replica's leader, SPEC 10c): its lease is no crash's leftover, and this batch waits.
    A finalizing batch counts: its assembly releases the lease once its files are written (a
    replica polling meanwhile superseded it, test_replicas_inprocess found). `batches`: the
    batches' manager, handed in (models imports this module)."""
    return batches.filter(pk=lease.holder.removeprefix(HOLDER_PREFIX), status__in=lifecycle.UNFINISHED,
                          claimed_by__in=Engine.objects.running().values("pk")).exists()


def is_held(batch):
    """A helper's check (SPEC 10c): the lease the batch's leader runs it under, its own or its
    caller's, is live on its model. Only the leader acquires and renews it."""
    lease = Lease.objects.filter(pk=batch.lease_id).first() if batch.lease_id else None
    return lease is not None and lease.live and lease.model_id == batch.model


def release_own(batch, reason):
    """The batch's own lease ends (never a caller's: the caller releases that one)."""
    if batch.lease_mode == OWN and batch.lease_id:
        Lease.objects.end_all(reason, pk=batch.lease_id)
