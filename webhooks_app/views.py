"""/v1/webhook_endpoints as OpenAI's SDK calls it (`client.webhooks.*`), plus each endpoint's
deliveries: a thin DRF viewset; behaviour lives on the models, bodies are validated by their
shapes (millm_lib/bodies.py)."""

from asgiref.sync import async_to_sync
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import viewsets
from rest_framework.response import Response

from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from millm_lib.openapi import PATH_ID, drf_errors
from millm_lib.pagination import list_page, query_int
from millm_lib.bodies import validate_body
from webhooks_app import sending, shapes
from webhooks_app.models import EVENT_TYPES, Delivery, WebhookEndpoint, event_body
from webhooks_app.shapes import (
    EndpointCreate, EndpointTest, EndpointUpdate, RotateSecret, WebhookDeliveryList, WebhookEndpointDeleted,
    WebhookEndpointList, WebhookEndpointObject, WebhookEndpointTestResult, WebhookEndpointWithSecret,
    WebhookEventTypeList,
)

CODE = "invalid_webhook_request"
PAGE = [
    OpenApiParameter("limit", int, OpenApiParameter.QUERY, description="1-100 (default 20)"),
    OpenApiParameter("after", str, OpenApiParameter.QUERY, description="The last id of the previous page"),
]


class WebhookEndpointViewSet(viewsets.ViewSet):
    @extend_schema(summary="List webhook endpoints, newest first", parameters=PAGE,
                   responses={200: WebhookEndpointList, **drf_errors()})
    def list(self, request):
        limit = query_int(request, "limit", 20, 1, 100)
        items, has_more = WebhookEndpoint.objects.owned_by(request.project).page(request.query_params.get("after"), limit)
        return Response(list_page(WebhookEndpointList, [shapes.endpoint_object(endpoint) for endpoint in items], has_more))

    @extend_schema(summary="Register a webhook endpoint; its signing secret is answered this once",
                   request=EndpointCreate, responses={200: WebhookEndpointWithSecret, **drf_errors()})
    def create(self, request):
        endpoint = WebhookEndpoint.register(**_fields(EndpointCreate, request), project=request.project)
        return Response(shapes.endpoint_object(endpoint, with_secret=True))

    @extend_schema(summary="A webhook endpoint", parameters=[PATH_ID],
                   responses={200: WebhookEndpointObject, **drf_errors()})
    def retrieve(self, request, pk=None):
        return Response(shapes.endpoint_object(_endpoint(request, pk)))

    @extend_schema(summary="Change a webhook endpoint's name, url or event types", operation_id="v1_webhook_endpoints_update",
                   parameters=[PATH_ID],
                   request=EndpointUpdate, responses={200: WebhookEndpointObject, **drf_errors()})
    def change(self, request, pk=None):
        endpoint = _endpoint(request, pk)
        return Response(shapes.endpoint_object(endpoint.change(**_fields(EndpointUpdate, request))))

    @extend_schema(summary="Delete a webhook endpoint; its pending deliveries are never sent", parameters=[PATH_ID],
                   responses={200: WebhookEndpointDeleted, **drf_errors()})
    def destroy(self, request, pk=None):
        _endpoint(request, pk).remove()
        return Response(WebhookEndpointDeleted(id=pk, object="webhook_endpoint.deleted", deleted=True))

    @extend_schema(summary="Send a signed sample event now and report the receiver's answer", parameters=[PATH_ID],
                   request=EndpointTest, responses={200: WebhookEndpointTestResult, **drf_errors()})
    def test(self, request, pk=None):
        endpoint = _endpoint(request, pk)
        event_type = validate_body(EndpointTest, request.data, CODE).event_type
        payload = event_body(event_type, {"id": new_id("batch_")}, timezone.now())
        attempt = async_to_sync(_send_once)(endpoint, payload)
        if attempt.status_code is None:
            raise ApiError(400, "webhook_test_failed", f"The test event to {endpoint.url} got no answer: {attempt.error}",
                           param="url")
        return Response(WebhookEndpointTestResult(object="webhook_endpoint.test", webhook_endpoint_id=endpoint.id,
                                                  event_type=event_type, status_code=attempt.status_code, success=True))

    @extend_schema(summary="A new signing secret (the old one may keep signing beside it for 24 hours)",
                   parameters=[PATH_ID], request=RotateSecret, responses={200: WebhookEndpointWithSecret, **drf_errors()})
    def rotate_secret(self, request, pk=None):
        endpoint = _endpoint(request, pk)
        keep_old = bool(validate_body(RotateSecret, request.data, CODE).keep_old_secret_active_for_24_hours)
        return Response(shapes.endpoint_object(endpoint.rotate_secret(keep_old), with_secret=True))

    @extend_schema(summary="An endpoint's deliveries, newest first (miServer's own)", parameters=[PATH_ID, *PAGE],
                   responses={200: WebhookDeliveryList, **drf_errors()})
    def deliveries(self, request, pk=None):
        endpoint = _endpoint(request, pk)
        limit = query_int(request, "limit", 20, 1, 100)
        items, has_more = Delivery.objects.filter(endpoint=endpoint).page(request.query_params.get("after"), limit)
        return Response(list_page(WebhookDeliveryList, [shapes.delivery_object(delivery) for delivery in items], has_more))

    @extend_schema(summary="The event types this server sends", responses={200: WebhookEventTypeList, **drf_errors()})
    def event_types(self, request):
        return Response(WebhookEventTypeList(object="list", data=list(EVENT_TYPES)))

    def perform_content_negotiation(self, request, force=False):
        return super().perform_content_negotiation(request, force=True)


def _endpoint(request, endpoint_id):
    """The caller's endpoint: another project's id is answered as an unknown one (SPEC 10d)."""
    endpoint = WebhookEndpoint.objects.owned_by(request.project).filter(pk=endpoint_id).first()
    if endpoint is None:
        raise ApiError(404, "webhook_endpoint_not_found", f"No webhook endpoint has the id '{endpoint_id}'",
                       param="webhook_endpoint_id")
    return endpoint


async def _send_once(endpoint, payload):
    async with sending.client() as client:
        return await sending.send(client, endpoint.url, new_id("wh_"), payload, endpoint.signing_secrets())


def _fields(model, request):
    """The endpoint fields a create (all) or an update (those sent, not null) sets."""
    return validate_body(model, request.data, CODE).model_dump(exclude_none=True)
