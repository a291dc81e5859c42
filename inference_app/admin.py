from django.contrib import admin

from inference_app.models import Engine, ModelEntry


@admin.register(ModelEntry)
class ModelEntryAdmin(admin.ModelAdmin):
    list_display = ["id", "kind", "state", "source_format", "dtype", "quantization", "context_length", "created_at"]
    list_filter = ["kind", "state", "source_format"]
    search_fields = ["id", "source"]
    readonly_fields = ["created_at", "updated_at"]


@admin.register(Engine)
class EngineAdmin(admin.ModelAdmin):
    list_display = ["id", "model_id", "resident_model_id", "role", "weights_state", "heartbeat_at", "in_flight", "queue_waiting"]
    list_filter = ["role", "weights_state"]
    search_fields = ["id", "model_id", "host"]
    readonly_fields = [field.name for field in Engine._meta.fields]
