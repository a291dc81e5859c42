"""The bodies the webhook endpoints API sends (OpenAI's, as its SDK reads them; deliveries are
miServer's own) and the bodies it takes, validated by the models /api/schema/ shows."""

from typing import ClassVar, Literal

from django.core.exceptions import ImproperlyConfigured
from drf_spectacular.utils import extend_schema_serializer
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from typing_extensions import Annotated

from millm_lib.bodies import refused
from millm_lib.shapes import Shape
from webhooks_app.models import EVENT_TYPES, NAME_MAX, stamp
from webhooks_app.targets import URL_MAX, url_problem

# Built once the apps are ready (the registering apps' configs have run): urls and schema import it.
if not EVENT_TYPES:
    raise ImproperlyConfigured("webhooks_app.shapes was imported before any app registered its event types")
EventType = Literal[tuple(EVENT_TYPES)]


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


def _allowed_url(url):
    """The receiver checks of targets.py (scheme, credentials, host, MILLM_WEBHOOK_ALLOWED_HOSTS)."""
    problem = url_problem(url)
    if problem is not None:
        raise refused(problem)
    return url


Name = Annotated[str, Field(min_length=1, max_length=NAME_MAX, pattern=r"\S")]
Url = Annotated[str, Field(min_length=1, max_length=URL_MAX, description="http(s), no credentials; a host "
                           "MILLM_WEBHOOK_ALLOWED_HOSTS allows"), AfterValidator(_allowed_url)]
# Each event type once, in the order first sent.
EventTypes = Annotated[list[EventType], Field(min_length=1), AfterValidator(lambda types: list(dict.fromkeys(types)))]
EVENT_TYPE_REFUSAL = "{param} is {got}: this server sends only {event_types}"
ENDPOINT_REFUSALS = {
    "name": (None, {"string_too_long": "name is {length} characters; the limit is {name_max}",
                    "": "name must be a non-empty string, got {got}"}),
    "url": (None, {"string_too_long": "url is {length} characters; the limit is {url_max}",
                   "": "url must be an http(s) URL, got {got}"}),
    "event_types": (None, {"": "event_types must be a non-empty list of event types, got {got}"}),
    "event_types.#": (None, EVENT_TYPE_REFUSAL),
}


class EndpointCreate(BaseModel):
    """POST /v1/webhook_endpoints: validated by this model (millm_lib/bodies.py); unknown keys are
    refused, and nothing is stored when one field is."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: Name
    url: Url
    event_types: EventTypes

    UNKNOWN: ClassVar[str] = "Unknown field '{name}'; a webhook endpoint takes {known}"
    REFUSALS: ClassVar[dict] = ENDPOINT_REFUSALS
    LIMITS: ClassVar[dict] = {"name_max": NAME_MAX, "url_max": URL_MAX, "event_types": ", ".join(EVENT_TYPES)}


class EndpointUpdate(EndpointCreate):
    """POST /v1/webhook_endpoints/{id}: any of the fields (null: unchanged)."""

    name: Name | None = None
    url: Url | None = None
    event_types: EventTypes | None = None


class EndpointTest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    event_type: EventType

    UNKNOWN: ClassVar[str] = "Unknown field '{name}'; a test takes {known}"
    REFUSALS: ClassVar[dict] = {"event_type": (None, EVENT_TYPE_REFUSAL)}
    LIMITS: ClassVar[dict] = {"event_types": ", ".join(EVENT_TYPES)}


class RotateSecret(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    keep_old_secret_active_for_24_hours: bool | None = None

    UNKNOWN: ClassVar[str] = "Unknown field '{name}'; a rotation takes {known}"
    REFUSALS: ClassVar[dict] = {
        "keep_old_secret_active_for_24_hours": (None, "keep_old_secret_active_for_24_hours must be true or false, "
                                                      "got {got}"),
    }


# --- the bodies, built from the rows ---

def endpoint_object(endpoint, with_secret=False):
    """A WebhookEndpoint as the API shows it; `with_secret` once, when it is made or rotated."""
    fields = dict(
        id=endpoint.id, object="webhook_endpoint", name=endpoint.name, url=endpoint.url,
        event_types=list(endpoint.event_types), created_at=stamp(endpoint.created_at),
        updated_at=stamp(endpoint.updated_at), signing_secret_hint=endpoint.secret_hint,
    )
    if with_secret:
        return WebhookEndpointWithSecret(**fields, signing_secret=endpoint.secret)
    return WebhookEndpointObject(**fields)


def delivery_object(delivery):
    """A Delivery as the API shows it: its next attempt only while it is pending."""
    return WebhookDeliveryObject(
        id=delivery.id, object="webhook_delivery", webhook_endpoint_id=delivery.endpoint_id, event_id=delivery.event_id,
        event_type=delivery.event_type, status=delivery.status, attempts=delivery.attempts,
        created_at=stamp(delivery.created_at), last_attempt_at=stamp(delivery.last_attempt_at),
        last_status_code=delivery.last_status_code, last_error=delivery.last_error or None,
        next_attempt_at=stamp(delivery.next_attempt_at) if delivery.status == delivery.Status.PENDING else None,
        delivered_at=stamp(delivery.delivered_at),
    )
