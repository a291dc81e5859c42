"""WebSocket at /ws/batches/ (every batch of the caller's project; an admin project's or a staff
session's: every batch) and /ws/batches/<id>/ (one): the current state on connect, then each
`batch:progress` event, as JSON {event, data}. Another project's batch is treated as an unknown
id: the socket opens and hears nothing (SPEC 10d)."""

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
        if self.batch_id:
            # Unknown, or another project's: no group, no snapshot, exactly alike.
            self.joined = [events.batch_group(self.batch_id)] if await self._owns_batch() else []
        else:
            self.joined = events.groups_for(self.project)
        for group in self.joined:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        # Joined first, then the snapshot: an event sent in between arrives after it, never lost.
        for state in await self._snapshot():
            await self.send_json({"event": events.EVENT, "data": state})

    async def disconnect(self, code):
        for group in getattr(self, "joined", ()):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def relay_event(self, message):
        await self.send_json({"event": message["event"], "data": message["data"]})

    @database_sync_to_async
    def _owns_batch(self):
        return Batch.objects.owned_by(self.project).filter(pk=self.batch_id).exists()

    @database_sync_to_async
    def _snapshot(self):
        owned = Batch.objects.owned_by(self.project)
        if self.batch_id:
            batch = owned.filter(pk=self.batch_id).first() if self.joined else None
            return [events.progress(batch)] if batch else []
        return [events.progress(batch) for batch in owned.unfinished().order_by("created_at")[:100]]

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
