from django.contrib import admin
from django.urls import include, path

from millm_lib.openapi import SchemaView

urlpatterns = [
    path("admin/", admin.site.urls),
    # The OpenAPI 3.1 schema of every route (millm_lib/openapi.py); a key is needed when keys are set.
    path("api/schema/", SchemaView.as_view(), name="schema"),
    path("", include("inference_app.urls")),
    path("", include("files_app.urls")),
    path("", include("batches_app.urls")),
    path("", include("webhooks_app.urls")),
    path("", include("responses_app.urls")),
]
