from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.paginator import Paginator
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect
from django.urls import path
from django.utils.html import format_html

from batches_app import events
from batches_app.models import Batch, BatchRow
from millm_lib.errors import ApiError
from millm_lib.streaming import file_response


# A batch's page: what an operator looks for first; the rest grouped and folded.
LEADING = ["id", "status", "waiting_reason", "total", "completed", "failed", "lease", "lease_mode", "endpoint", "model"]
FOLDED = {
    "Files": ["input_file", "output_file", "error_file"],
    # Each state's stamp (validating has none: it is created_at), in the model's order.
    "Times": ["created_at", "expires_at",
              *(field.name for field in Batch._meta.fields
                if field.name.endswith("_at") and field.name[:-3] in Batch.Status.values)],
    "Options": ["completion_window", "metadata", "pack", "pack_window", "batched_decoding", "output_expires_after"],
}


def batch_fieldsets():
    placed = set(LEADING).union(*FOLDED.values())
    internals = [field.name for field in Batch._meta.fields if field.name not in placed]
    return [
        (None, {"fields": LEADING}),
        *[(name, {"fields": fields, "classes": ["collapse"]}) for name, fields in FOLDED.items()],
        ("Internals", {"fields": internals, "classes": ["collapse"]}),
    ]


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ["id", "status", "endpoint", "model", "progress", "total", "completed", "failed",
                    "waiting_reason", "lease_mode", "created_at", "expires_at"]
    list_filter = ["status", "endpoint", "model", "waiting_reason"]
    search_fields = ["id", "metadata"]
    readonly_fields = [field.name for field in Batch._meta.fields]
    fieldsets = batch_fieldsets()
    actions = ["cancel"]
    change_form_template = "admin/batches_app/batch/change_form.html"
    rows_per_page = 50

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        """The batch page's progress, cancel button, files and rows (filtered by outcome), for
        the batch the admin looked up."""
        if obj is not None:
            outcome = request.GET.get("outcome")
            rows = obj.rows.order_by("line").only("line", "custom_id", "outcome", "packed", "request_id", "error", "response",
                                                     "ran_by")
            if outcome in BatchRow.Outcome.values:
                rows = rows.filter(outcome=outcome)
            context.update(
                rows=Paginator(rows, self.rows_per_page).get_page(request.GET.get("rows_page")),
                outcome=outcome if outcome in BatchRow.Outcome.values else "",
                outcomes=BatchRow.Outcome.values,
                downloads=[(which, file) for which, file in self._files(obj) if file is not None],
                done=obj.completed + obj.failed,
                pace=_pace(obj),
                cancellable=obj.status in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS),
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self):
        cancel = path("<path:object_id>/cancel/", self.admin_site.admin_view(self.cancel_view), name="batches_app_batch_cancel")
        download = path("<path:object_id>/download/<str:which>/", self.admin_site.admin_view(self.download_view),
                        name="batches_app_batch_download")
        return [cancel, download, *super().get_urls()]

    @staticmethod
    def _files(batch):
        return [("input", batch.input_file), ("output", batch.output_file), ("error", batch.error_file)]

    def download_view(self, request, object_id, which):
        """A batch's input, output or error file, streamed from storage (staff only: admin_view)."""
        batch = get_object_or_404(Batch, pk=unquote(object_id))
        file = dict(self._files(batch)).get(which)
        if file is None:
            raise Http404(f"{batch.id} has no {which} file")
        try:
            content = file.open_content()
        except ApiError as error:  # expired or gone: the record stays, the bytes do not
            self.message_user(request, error.message, messages.WARNING)
            return redirect("admin:batches_app_batch_change", quote(batch.pk))
        return file_response(content, as_attachment=True, filename=file.filename, content_type="application/jsonl")

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

    def has_change_permission(self, request, obj=None):
        # Every field is the server's to write: a batch's page shows no Save (the list keeps its
        # cancel action, and the page its cancel button).
        return obj is None and super().has_change_permission(request)

    def delete_model(self, request, obj):
        Batch.objects.filter(pk=obj.pk).delete_ended()

    def delete_queryset(self, request, queryset):
        unfinished = queryset.filter(status__in=Batch.UNFINISHED).count()
        if unfinished:
            self.message_user(request, f"{unfinished} unfinished batch(es) left: cancel them first", messages.WARNING)
        queryset.delete_ended()

    def has_delete_permission(self, request, obj=None):
        # Deleting a batch deletes its rows: never under a running engine.
        if obj is not None and obj.status in Batch.UNFINISHED:
            return False
        return super().has_delete_permission(request, obj)


def _pace(batch):
    """'N rows/s, ETA M s' while a batch runs (since it started running), else ''."""
    rate = batch.rows_per_second()
    if rate is None:
        return ""
    eta = f"{(batch.total - batch.completed - batch.failed) / rate:,.0f} s" if rate > 0 else "unknown"
    return f"{rate:.1f} rows/s, ETA {eta}"
