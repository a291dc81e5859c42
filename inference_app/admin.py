from django.contrib import admin

from inference_app.models import Engine, Lease, ModelEntry, Probe


class MadeElsewhere:
    """Rows only the API or the engine creates: no "Add" here."""

    def has_add_permission(self, request):
        return False


@admin.register(ModelEntry)
class ModelEntryAdmin(admin.ModelAdmin):
    list_display = ["id", "kind", "state", "source_format", "dtype", "quantization", "context_length", "created_at"]
    list_filter = ["kind", "state", "source_format"]
    search_fields = ["id", "source"]
    # What is resident and how its weights stand are the engine's to say, never a hand's.
    readonly_fields = ["state", "weights_state", "created_at", "updated_at"]


@admin.register(Engine)
class EngineAdmin(MadeElsewhere, admin.ModelAdmin):
    list_display = ["id", "model_id", "resident_model_id", "role", "weights_state", "heartbeat_at", "in_flight", "queue_waiting"]
    list_filter = ["role", "weights_state"]
    search_fields = ["id", "model_id", "host"]
    readonly_fields = [field.name for field in Engine._meta.fields]


@admin.register(Lease)
class LeaseAdmin(MadeElsewhere, admin.ModelAdmin):
    list_display = ["model_id", "holder", "reason", "acquired_at", "expires_at", "ended_at", "end_reason"]
    list_filter = ["model_id", "end_reason"]
    search_fields = ["holder", "reason", "model_id"]
    # The id is stored hashed and never shown; nothing here is edited by hand.
    exclude = ["id_hash"]
    readonly_fields = [field.name for field in Lease._meta.fields if field.name != "id_hash"]
    actions = ["end"]

    @admin.action(description="End the selected leases (as their holder's release would)")
    def end(self, request, queryset):
        ended = sum(lease.release() for lease in queryset)
        self.message_user(request, f"Ended {ended} lease(s); any already ended were left as they were.")


@admin.register(Probe)
class ProbeAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "model_id", "layer", "aggregation", "threshold", "created_at"]
    list_filter = ["model_id", "aggregation"]
    search_fields = ["id", "name", "model_id"]
    readonly_fields = ["id", "created_at"]
