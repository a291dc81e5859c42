from django.apps import AppConfig


class ResponsesAppConfig(AppConfig):
    name = "responses_app"
    verbose_name = "Responses"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from inference_app.schemas import register_schema
        from millm_lib.limits import RESPONSES
        from projects_app.models import register_stored_bytes
        from responses_app.models import responses_stored_bytes
        from responses_app.requests import ResponseRequest

        register_schema(RESPONSES, ResponseRequest)  # the route, batch validation and the runner parse it
        register_stored_bytes(responses_stored_bytes)  # the file_bytes quota counts stored responses
