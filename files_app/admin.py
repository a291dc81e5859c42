from django.contrib import admin

from files_app.models import File


@admin.register(File)
class FileAdmin(admin.ModelAdmin):
    list_display = ["id", "filename", "purpose", "status", "bytes", "line_count", "created_at", "expires_at"]
    list_filter = ["purpose", "status"]
    search_fields = ["id", "filename"]
    readonly_fields = [field.name for field in File._meta.fields]
