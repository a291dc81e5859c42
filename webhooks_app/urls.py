from django.urls import path

from webhooks_app.views import WebhookEndpointViewSet as Endpoints

ENDPOINT = "v1/webhook_endpoints/<str:pk>"

urlpatterns = [
    path("v1/webhook_endpoints", Endpoints.as_view({"get": "list", "post": "create"}), name="webhook-endpoints"),
    # The SDK changes an endpoint with POST, as OpenAI's API does.
    path(ENDPOINT, Endpoints.as_view({"get": "retrieve", "post": "change", "delete": "destroy"}), name="webhook-endpoint"),
    path(f"{ENDPOINT}/test", Endpoints.as_view({"post": "test"}), name="webhook-endpoint-test"),
    path(f"{ENDPOINT}/rotate_secret", Endpoints.as_view({"post": "rotate_secret"}), name="webhook-endpoint-rotate"),
    path(f"{ENDPOINT}/deliveries", Endpoints.as_view({"get": "deliveries"}), name="webhook-endpoint-deliveries"),
    path("v1/webhook_event_types", Endpoints.as_view({"get": "event_types"}), name="webhook-event-types"),
]
