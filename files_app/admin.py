from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.shortcuts import redirect

from files_app.models import File
from millm_lib.errors import ApiError


@admin.register(File)
class FileAdmin(admin.ModelAdmin):
    list_display = ["id", "filename", "purpose", "status", "bytes", "line_count", "created_at", "expires_at"]
    list_filter = ["purpose", "status"]
    search_fields = ["id", "filename"]
    readonly_fields = [field.name for field in File._meta.fields]

    def has_add_permission(self, request):
        return False  # files come from uploads and from batches' assembly

    def delete_view(self, request, object_id, extra_context=None):
        """Refused, with the reason, before the confirmation page while a batch needs the file."""
        file = File.objects.filter(pk=unquote(object_id)).first()
        user = file.unfinished_user() if file is not None else None
        if user is not None:
            self.message_user(request, f"{file.id} cannot be deleted: {user} needs it until it ends", messages.ERROR)
            return redirect("admin:files_app_file_change", object_id)
        return super().delete_view(request, object_id, extra_context)

    def delete_model(self, request, obj):
        self._remove(request, obj)

    def delete_queryset(self, request, queryset):
        for file in queryset:
            self._remove(request, file)

    def _remove(self, request, file):
        """File.remove, as DELETE /v1/files/{id}: the bytes go, the record stays `deleted`."""
        try:
            file.remove()
        except ApiError as error:
            self.message_user(request, error.message, messages.ERROR)
