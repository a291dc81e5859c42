from django.apps import AppConfig


class BatchesAppConfig(AppConfig):
    name = "batches_app"
    verbose_name = "Batches"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from batches_app import lifecycle
        from batches_app.metrics import BatchCollector
        from batches_app.models import BatchRow
        from batches_app.usage import usage
        from inference_app import backlog
        from millm_lib.metrics import register_collector
        from projects_app.admin import usage_readers
        from webhooks_app.models import register_event_types

        register_collector(BatchCollector)
        register_event_types(lifecycle.END_EVENT_TYPES)  # the webhooks each end sends
        backlog.register(BatchRow.objects.backlog)  # health's batch_backlog_rows
        if usage not in usage_readers:
            usage_readers.append(usage)  # the project admin's use column
