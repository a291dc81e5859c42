from django.apps import AppConfig


class FilesAppConfig(AppConfig):
    name = "files_app"
    verbose_name = "Files"
    default_auto_field = "django.db.models.BigAutoField"
