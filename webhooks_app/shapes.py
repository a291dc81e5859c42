"""The bodies the webhook endpoints API sends (OpenAI's, as its SDK reads them; deliveries are
miServer's own) and the bodies it takes, as /api/schema/ shows them (requests.py checks them)."""

from typing import Literal

from drf_spectacular.utils import extend_schema_serializer
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import Annotated

from millm_lib.shapes import Shape
from webhooks_app.models import BATCH_EVENT_TYPES, NAME_MAX

EventType = Literal[BATCH_EVENT_TYPES]


class WebhookEndpointObject(Shape):
    id: str
    object: Literal["webhook_endpoint"]
    name: str
    url: str
    event_types: list[str]
    created_at: int
    updated_at: int | None
    signing_secret_hint: str | None


class WebhookEndpointWithSecret(WebhookEndpointObject):
    signing_secret: str


@extend_schema_serializer(many=False)  # a list page is one object, not an array of them
class WebhookEndpointList(Shape):
    object: Literal["list"]
    data: list[WebhookEndpointObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class WebhookEndpointDeleted(Shape):
    id: str
    object: Literal["webhook_endpoint.deleted"]
    deleted: bool


class WebhookEndpointTestResult(Shape):
    object: Literal["webhook_endpoint.test"]
    webhook_endpoint_id: str
    event_type: str
    status_code: int
    success: Literal[True]


class WebhookEventTypeList(Shape):
    object: Literal["list"]
    data: list[str]


class WebhookDeliveryObject(Shape):
    id: str
    object: Literal["webhook_delivery"]
    webhook_endpoint_id: str
    event_id: str
    event_type: str
    status: Literal["pending", "succeeded", "failed"]
    attempts: int
    created_at: int
    last_attempt_at: int | None
    last_status_code: int | None
    last_error: str | None
    next_attempt_at: int | None
    delivered_at: int | None


class WebhookDeliveryList(Shape):
    object: Literal["list"]
    data: list[WebhookDeliveryObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class EndpointCreate(BaseModel):
    """POST /v1/webhook_endpoints; unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=NAME_MAX)]
    url: Annotated[str, Field(min_length=1, max_length=2048, description="http(s), no credentials")]
    event_types: Annotated[list[EventType], Field(min_length=1)]


class EndpointUpdate(BaseModel):
    """POST /v1/webhook_endpoints/{id}: any of the fields."""

    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=NAME_MAX)] | None = None
    url: Annotated[str, Field(min_length=1, max_length=2048)] | None = None
    event_types: Annotated[list[EventType], Field(min_length=1)] | None = None


class EndpointTest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    event_type: EventType


class RotateSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keep_old_secret_active_for_24_hours: bool | None = None
