from django.urls import path

from responses_app import views

urlpatterns = [
    path("v1/responses", views.create),
    path("v1/responses/<str:response_id>/input_items", views.input_items),
    path("v1/responses/<str:response_id>", views.stored),
]
