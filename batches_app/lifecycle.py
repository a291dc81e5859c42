"""A batch's life cycle vocabulary (SPEC 6): its states, the reasons it waits, which states are
unfinished and which are ends, and the webhook event each end sends. Everything else derives from
these: `Batch`'s fields and transitions, the API's shapes, the admin, and the event types
`batches_app` registers with `webhooks_app`."""

from django.db import models


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
ENDED = [Status.COMPLETED, Status.FAILED, Status.EXPIRED, Status.CANCELLED]


def end_event_type(status):
    """The webhook event a batch's end sends: `batch.completed`, `batch.failed`, ..."""
    return f"batch.{status}"


END_EVENT_TYPES = tuple(end_event_type(status) for status in ENDED)
