from django.apps import AppConfig


class BatchesAppConfig(AppConfig):
    name = "batches_app"
    verbose_name = "Batches"
    default_auto_field = "django.db.models.BigAutoField"
