from django.urls import path

from inference_app import views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions),
    path("v1/completions", views.completions),
    path("v1/embeddings", views.embeddings),
    path("v1/models", views.models_list),
    path("v1/models/<path:model_id>", views.model_detail),
    path("api/health", views.health),
    path("api/health/detailed", views.health_detailed),
    path("metrics", views.metrics_view),
]
