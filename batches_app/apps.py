from django.apps import AppConfig


class BatchesAppConfig(AppConfig):
    name = "batches_app"
    verbose_name = "Batches"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from batches_app import metrics as batch_metrics
        from inference_app import metrics

        batch_metrics.register(metrics.registry)
