from django.apps import AppConfig


class WebhooksAppConfig(AppConfig):
    name = "webhooks_app"
    verbose_name = "Webhooks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from millm_lib.metrics import register_collector
        from webhooks_app.metrics import WebhookCollector

        register_collector(WebhookCollector)
