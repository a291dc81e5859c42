from django.contrib import admin, messages
from django.utils.html import format_html

from batches_app.models import Batch, BatchRow
from inference_app.errors import ApiError


class BatchRowInline(admin.TabularInline):
    model = BatchRow
    fields = ["line", "custom_id", "outcome", "packed", "request_id", "recorded_at"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = False
    ordering = ["line"]
    max_num = 0

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ["id", "status", "endpoint", "model", "progress", "total", "completed", "failed",
                    "waiting_reason", "lease_mode", "created_at", "expires_at"]
    list_filter = ["status", "endpoint", "model", "waiting_reason"]
    search_fields = ["id", "metadata"]
    readonly_fields = [field.name for field in Batch._meta.fields]
    inlines = [BatchRowInline]
    actions = ["cancel"]

    @admin.display(description="progress")
    def progress(self, batch):
        done = batch.completed + batch.failed
        share = int(100 * done / batch.total) if batch.total else 0
        return format_html(
            '<progress max="100" value="{}" title="{} of {}"></progress> {}%', share, done, batch.total, share
        )

    @admin.action(description="Cancel the selected batches")
    def cancel(self, request, queryset):
        for batch in queryset:
            try:
                batch.request_cancel()  # the very method POST /v1/batches/{id}/cancel calls
            except ApiError as error:
                self.message_user(request, error.message, messages.WARNING)

    def has_add_permission(self, request):
        return False
