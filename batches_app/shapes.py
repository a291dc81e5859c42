"""The bodies the Batch API sends (built by calling these shapes, documented from them) and the
create body it takes, as /api/schema/ shows it (creation.py checks it field by field)."""

from typing import Annotated, Literal

from drf_spectacular.utils import extend_schema_serializer
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import NotRequired

from batches_app.lifecycle import Status
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
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=EXPIRES_AFTER_MIN_S, le=EXPIRES_AFTER_MAX_S)]


class BatchCreate(BaseModel):
    """POST /v1/batches; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: Annotated[str, Field(min_length=1)]
    endpoint: Literal[BATCH_ENDPOINTS]
    completion_window: Annotated[str, Field(pattern=r"^[1-9][0-9]{0,3}h$", description='"24h", or whole hours "1h"-"168h"')]
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    output_expires_after: OutputExpiresAfter | None = None
    pack: bool | None = None
    pack_window: Annotated[int, Field(ge=0)] | None = None
    batched_decoding: bool | None = None
