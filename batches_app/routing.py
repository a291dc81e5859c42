from django.urls import re_path

from batches_app.consumers import BatchProgressConsumer

websocket_urlpatterns = [
    re_path(r"^ws/batches/(?P<batch_id>batch_[0-9a-f]{24})/$", BatchProgressConsumer.as_asgi()),
    re_path(r"^ws/batches/$", BatchProgressConsumer.as_asgi()),
]
