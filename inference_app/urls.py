from django.urls import path

from inference_app import api_views, views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions),
    path("v1/completions", views.completions),
    path("v1/embeddings", views.embeddings),
    path("v1/models", views.models_list),
    path("v1/models/<path:model_id>", views.model_detail),
    path("api/health", views.health),
    path("api/health/detailed", views.health_detailed),
    path("metrics", views.metrics_view),
    # Model ids hold "/" and ":", so the suffixed routes come before the bare one.
    path("api/models", api_views.models),
    path("api/models/<path:model_id>/lease/renew", api_views.lease_renew),
    path("api/models/<path:model_id>/lease", api_views.lease),
    path("api/models/<path:model_id>/load", api_views.model_load),
    path("api/models/<path:model_id>/weights/begin", api_views.weights_begin),
    path("api/models/<path:model_id>/weights/commit", api_views.weights_commit),
    path("api/models/<path:model_id>/weights", api_views.weights_write),
    path("api/models/<path:model_id>/save", api_views.model_save),
    path("api/models/<path:model_id>/unload", api_views.model_unload),
    path("api/models/<path:model_id>", api_views.model),
    path("api/probes", api_views.probes),
    path("api/probes/score", api_views.probe_score),
    path("api/probes/<str:probe_id>", api_views.probe),
]
