"""ASGI entry point: `uvicorn millm_site.asgi:application` (web) or `manage.py runserver`.

HTTP goes to Django behind a guard that refuses a declared oversize body before reading it.
WebSocket and Socket.IO routes join this router in the progress-events issue.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_application = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

from millm_site.middleware import BodyLimitASGI  # noqa: E402

application = ProtocolTypeRouter({"http": BodyLimitASGI(django_application)})
