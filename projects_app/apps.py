from django.apps import AppConfig


class ProjectsAppConfig(AppConfig):
    name = "projects_app"
    verbose_name = "Projects and keys"
    default_auto_field = "django.db.models.BigAutoField"
