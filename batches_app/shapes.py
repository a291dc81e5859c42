"""The bodies the Batch API sends (built by calling these shapes, documented from them) and the
create body it takes, validated by the model /api/schema/ shows (`BatchCreate`)."""

from typing import Annotated, ClassVar, Literal

from drf_spectacular.utils import extend_schema_serializer
from django.conf import settings
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from typing_extensions import NotRequired

from batches_app.lifecycle import Status
from millm_lib.bodies import refused, shown
from millm_lib.limits import BATCH_ENDPOINTS, EXPIRES_AFTER_MAX_S, EXPIRES_AFTER_MIN_S
from millm_lib.shapes import Shape


class BatchErrorItem(Shape):
    code: str
    line: int | None
    message: str
    param: NotRequired[Annotated[str | None, Field(default=None)]]


class BatchErrors(Shape):
    object: Literal["list"]
    data: list[BatchErrorItem]


class RequestCounts(Shape):
    total: int
    completed: int
    failed: int


class CachedTokens(Shape):
    cached_tokens: int


class ReasoningTokens(Shape):
    reasoning_tokens: int


class BatchUsage(Shape):
    input_tokens: int
    input_tokens_details: CachedTokens
    output_tokens: int
    output_tokens_details: ReasoningTokens
    total_tokens: int


class BatchMillm(Shape):
    pack: bool
    pack_window: int
    batched_decoding: bool
    prefix_reuse: bool
    waiting_reason: Literal["queued", "model_not_resident", "lease_unavailable", "weights_torn"] | None
    lease_mode: Literal["own", "caller"] | None
    output_expires_after: int | None


class BatchObject(Shape):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal[tuple(Status.values)]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    usage: BatchUsage
    millm: BatchMillm


@extend_schema_serializer(many=False)
class BatchList(Shape):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=EXPIRES_AFTER_MIN_S, le=EXPIRES_AFTER_MAX_S)]


WINDOW_MAX_HOURS = settings.BATCH_MAX_COMPLETION_WINDOW_HOURS
PACK_WINDOW_MAX = settings.BATCH_PACK_WINDOW_MAX
WINDOW_REFUSAL = "completion_window must be '24h' or whole hours from '1h' to '{window_max}h', got {got}"


def _window_hours(value):
    """'24h' -> 24, within BATCH_MAX_COMPLETION_WINDOW_HOURS."""
    hours = int(value[:-1])
    if hours > WINDOW_MAX_HOURS:
        raise refused(WINDOW_REFUSAL.format(window_max=WINDOW_MAX_HOURS, got=shown(value)))
    return value


class BatchCreate(BaseModel):
    """POST /v1/batches: validated by this model (millm_lib/bodies.py), which the schema shows;
    unknown keys are refused. The input file's own checks (it exists, is the caller's, has
    purpose batch and has not expired) are creation.py's: they read the database."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: Annotated[str, Field(min_length=1, description="A file uploaded with purpose batch")]
    endpoint: Literal[BATCH_ENDPOINTS]
    completion_window: Annotated[str, Field(pattern=r"^[1-9][0-9]{0,3}h$",
                                            description=f'"24h", or whole hours "1h"-"{WINDOW_MAX_HOURS}h" '
                                                        "(BATCH_MAX_COMPLETION_WINDOW_HOURS)"),
                                 AfterValidator(_window_hours)]
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    output_expires_after: OutputExpiresAfter | None = None
    pack: bool | None = Field(None, description="default BATCH_PACK_DEFAULT")
    pack_window: Annotated[int, Field(ge=0, le=PACK_WINDOW_MAX, description="rows; BATCH_PACK_WINDOW_MAX")] | None = None
    batched_decoding: bool | None = Field(None, description="default BATCH_DECODING_DEFAULT")
    prefix_reuse: bool | None = Field(None, description="shared prefixes computed once (with pack or batched_decoding); "
                                                        "default false")

    UNKNOWN: ClassVar[str] = "Unknown field '{name}'; a batch takes {known}"
    REFUSALS: ClassVar[dict] = {
        "input_file_id": ("input_file_id", "input_file_id is required: the id of a file uploaded with purpose batch, "
                                           "got {got}"),
        "endpoint": ("endpoint", "endpoint must be one of {endpoints}, got {got}"),
        "completion_window": ("completion_window", WINDOW_REFUSAL),
        "metadata": ("metadata", "metadata must be an object of at most 16 string pairs, keys of at most 64 "
                                 "characters and values of at most 512, got {got}"),
        "output_expires_after": ("output_expires_after.anchor",
                                 'output_expires_after must be {{"anchor": "created_at", "seconds": N}}, got {got}'),
        "output_expires_after.seconds": ("output_expires_after.seconds", "output_expires_after.seconds must be from "
                                                                         "{expires_min:,} to {expires_max:,}, got {got}"),
        "pack": ("pack", "pack must be true or false, got {got}"),
        "pack_window": ("pack_window", "pack_window must be a whole number from 0 to {pack_window_max} "
                                       "(BATCH_PACK_WINDOW_MAX), got {got}"),
        "batched_decoding": ("batched_decoding", "batched_decoding must be true or false, got {got}"),
        "prefix_reuse": ("prefix_reuse", "prefix_reuse must be true or false, got {got}"),
    }
    LIMITS: ClassVar[dict] = {
        "endpoints": ", ".join(BATCH_ENDPOINTS), "window_max": WINDOW_MAX_HOURS, "expires_min": EXPIRES_AFTER_MIN_S,
        "expires_max": EXPIRES_AFTER_MAX_S, "pack_window_max": PACK_WINDOW_MAX,
    }
