from django.contrib import admin

from webhooks_app.models import Delivery, WebhookEndpoint


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(admin.ModelAdmin):
    """Endpoints are registered through the API, which answers their signing secret once: no
    "Add", and the secret never shows (its hint does). Deleting one drops its pending deliveries."""

    list_display = ["id", "name", "url", "event_types", "secret_hint", "created_at", "updated_at"]
    search_fields = ["id", "name", "url"]
    exclude = ["secret", "previous_secret"]
    readonly_fields = ["id", "name", "url", "event_types", "secret_hint", "previous_secret_until", "created_at", "updated_at"]

    def has_add_permission(self, request):
        return False


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin):
    list_display = ["id", "event_type", "endpoint", "status", "attempts", "last_status_code", "last_error",
                    "next_attempt_at", "created_at"]
    list_filter = ["status", "event_type"]
    search_fields = ["id", "event_id", "endpoint__id", "endpoint__name", "payload"]
    readonly_fields = [field.name for field in Delivery._meta.fields]
    actions = ["retry_now"]

    @admin.action(description="Retry the selected deliveries now")
    def retry_now(self, request, queryset):
        chosen = [delivery for delivery in queryset if delivery.status != Delivery.Status.SUCCEEDED]
        for delivery in chosen:
            delivery.retry_now()
        self.message_user(request, f"{len(chosen)} delivery(ies) due now; delivered ones were left as they were.")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return obj is None  # the list and its action; a delivery's page is for reading

    def has_delete_permission(self, request, obj=None):
        return False
