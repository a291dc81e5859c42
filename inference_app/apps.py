from django.apps import AppConfig


class InferenceAppConfig(AppConfig):
    name = "inference_app"
    verbose_name = "Inference"
    default_auto_field = "django.db.models.BigAutoField"
