from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect
from django.urls import path
from django.utils.html import format_html

from batches_app import events
from batches_app.models import Batch
from millm_lib.errors import ApiError


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ["id", "status", "endpoint", "model", "progress", "total", "completed", "failed",
                    "waiting_reason", "lease_mode", "created_at", "expires_at"]
    list_filter = ["status", "endpoint", "model", "waiting_reason"]
    search_fields = ["id", "metadata"]
    readonly_fields = [field.name for field in Batch._meta.fields]
    actions = ["cancel"]
    change_form_template = "admin/batches_app/batch/change_form.html"
    rows_per_page = 50

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        """The batch page's progress, cancel button and rows, for the batch the admin looked up."""
        if obj is not None:
            rows = Paginator(obj.rows.order_by("line").only("line", "custom_id", "outcome", "packed", "request_id"), self.rows_per_page)
            context.update(
                rows=rows.get_page(request.GET.get("rows_page")),
                done=obj.completed + obj.failed,
                cancellable=obj.status in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS),
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self):
        cancel = path("<path:object_id>/cancel/", self.admin_site.admin_view(self.cancel_view), name="batches_app_batch_cancel")
        return [cancel, *super().get_urls()]

    def cancel_view(self, request, object_id):
        batch = get_object_or_404(Batch, pk=unquote(object_id))
        if request.method == "POST":
            try:
                batch.request_cancel()  # the very method POST /v1/batches/{id}/cancel calls
                events.publish_and_wake(batch)
                self.message_user(request, f"Cancelling {batch.id}.")
            except ApiError as error:
                self.message_user(request, error.message, messages.WARNING)
        return redirect("admin:batches_app_batch_change", quote(batch.pk))

    @admin.display(description="progress")
    def progress(self, batch):
        done = batch.completed + batch.failed
        share = int(100 * done / batch.total) if batch.total else 0
        return format_html(
            '<progress max="100" value="{}" title="{} of {}"></progress> {}%', share, done, batch.total, share
        )

    @admin.action(description="Cancel the selected batches")
    def cancel(self, request, queryset):
        cancelling = []
        for batch in queryset:
            try:
                batch.request_cancel()  # the very method POST /v1/batches/{id}/cancel calls
                cancelling.append(batch)
            except ApiError as error:
                self.message_user(request, error.message, messages.WARNING)
        events.publish_and_wake(*cancelling)

    def has_add_permission(self, request):
        return False
