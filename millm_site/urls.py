from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("inference_app.urls")),
    path("", include("files_app.urls")),
    path("", include("batches_app.urls")),
]
