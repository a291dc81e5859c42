from django.apps import AppConfig


class InferenceAppConfig(AppConfig):
    name = "inference_app"
    verbose_name = "Inference"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from inference_app.metrics import EngineCollector
        from millm_lib.metrics import register_collector

        register_collector(EngineCollector)
