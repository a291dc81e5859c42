from django.apps import AppConfig


class BatchesAppConfig(AppConfig):
    name = "batches_app"
    verbose_name = "Batches"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from batches_app.metrics import BatchCollector
        from inference_app.metrics import register_collector

        register_collector(BatchCollector)
