from pathlib import Path

from django.apps import AppConfig
from django.conf import settings


class FilesAppConfig(AppConfig):
    name = "files_app"
    verbose_name = "Files"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from files_app.models import files_stored_bytes
        from projects_app.models import register_stored_bytes

        register_stored_bytes(files_stored_bytes)  # the file_bytes quota counts stored files
        # Uploads stream into this folder; it must exist before the first one arrives.
        Path(settings.FILE_UPLOAD_TEMP_DIR).mkdir(parents=True, exist_ok=True)
