"""WebSocket at /ws/batches/ (every batch) and /ws/batches/<id>/ (one): the current state on
connect, then each `batch:progress` event, as JSON {event, data}."""

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from batches_app import events
from batches_app.models import Batch
from millm_lib.keys import origin_allowed, socket_key
from projects_app.access import project_for_key


class BatchProgressConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        if not self._same_origin() or not await database_sync_to_async(self._authorised)():
            await self.close(code=4401)
            return
        self.batch_id = self.scope["url_route"]["kwargs"].get("batch_id")
        self.group = events.batch_group(self.batch_id) if self.batch_id else events.ALL_BATCHES
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        # Joined first, then the snapshot: an event sent in between arrives after it, never lost.
        for state in await self._snapshot():
            await self.send_json({"event": events.EVENT, "data": state})

    async def disconnect(self, code):
        if getattr(self, "group", None):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def relay_event(self, message):
        await self.send_json({"event": message["event"], "data": message["data"]})

    @database_sync_to_async
    def _snapshot(self):
        if self.batch_id:
            batch = Batch.objects.filter(pk=self.batch_id).first()
            return [events.progress(batch)] if batch else []
        return [events.progress(batch) for batch in Batch.objects.unfinished().order_by("created_at")[:100]]

    def _same_origin(self):
        headers = dict(self.scope.get("headers") or [])
        origin = headers.get(b"origin", b"").decode("latin-1")
        return origin_allowed(origin, headers.get(b"host", b"").decode("latin-1"), settings.MILLM_ALLOWED_ORIGINS)

    def _authorised(self):
        """A staff session (the admin's own page) needs no key; any other client an active key
        (or none while no key exists). Sets `self.project`: None sees every batch."""
        user = self.scope.get("user")
        if user is not None and user.is_active and user.is_staff:
            self.project = None
            return True
        headers = dict(self.scope.get("headers") or [])
        token = socket_key(headers.get(b"authorization", b""), self.scope.get("query_string", b""))
        self.project = project_for_key(token)
        return self.project is not None
