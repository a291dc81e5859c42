"""`batch:progress` events (SPEC 10, "Progress"), sent after the commit they describe.

The database row is the truth; an event only says "look, this changed". Events go over the
Channels layer to every web process: to the group of all batches (admin projects and staff
sessions listen there), to the group of the batch's project (its owner's connections) and to the
batch's own group. The WebSocket consumer relays them; Socket.IO clients get them through the
same layer, in the rooms of the same names. A connection joins only what `groups_for` (or
`rooms_for`) gives its project, so an event reaches only its owner (SPEC 10d).
"""

import logging
import time

from django.conf import settings

from inference_app import events as inference_events
from inference_app.gateway import wake_engines
from projects_app.models import DEFAULT_PROJECT

log = logging.getLogger("millm.batches")

EVENT = "batch:progress"
ALL_BATCHES = "millm.batches"
ALL_ROOM = "batches"
UNOWNED = "none"  # a batch with no project (made before projects) is the default project's


def batch_group(batch_id):
    return f"millm.batch.{batch_id}"


def batch_room(batch_id):
    return f"batch:{batch_id}"


def project_group(project_id):
    return f"millm.batches.project.{project_id or UNOWNED}"


def project_room(project_id):
    return f"project:{project_id or UNOWNED}"


def groups_for(project):
    """The Channels groups a connection of `project` hears every batch of its own through: all
    batches for an admin project or a staff session (None); the default project's also hear the
    batches with no project, as `owned_by` has it."""
    return _names_for(project, ALL_BATCHES, project_group)


def rooms_for(project):
    """The Socket.IO rooms of `groups_for`."""
    return _names_for(project, ALL_ROOM, project_room)


def _names_for(project, everything, of_project):
    if project is None or project.is_admin:
        return [everything]
    if project.name == DEFAULT_PROJECT:
        return [of_project(project.pk), of_project(None)]
    return [of_project(project.pk)]


def progress(batch):
    return {
        "id": batch.id,
        "status": batch.status,
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "waiting_reason": batch.waiting_reason if batch.status == "in_progress" else None,
    }


def publish(batch):
    """Send `batch:progress` for `batch` as it is now (from synchronous code)."""
    inference_events.publish(EVENT, progress(batch), _groups(batch), _rooms(batch))


async def apublish(batch):
    await inference_events.apublish(EVENT, progress(batch), _groups(batch), _rooms(batch))


def publish_and_wake(*batches):
    """After a create or a cancel: `batch:progress` for each batch, then one wake, so that the
    engines act now rather than at their next poll (BATCH_WAIT_POLL_S)."""
    for batch in batches:
        publish(batch)
    wake_engines()


def _groups(batch):
    return [ALL_BATCHES, project_group(batch.project_id), batch_group(batch.id)]


def _rooms(batch):
    # One emit to the three rooms: a client in several of them still hears it once.
    return [ALL_ROOM, project_room(batch.project_id), batch_room(batch.id)]


class Throttle:
    """At most one chunk event per BATCH_PROGRESS_MIN_INTERVAL_S per batch; a change of status
    or waiting reason always goes out."""

    def __init__(self):
        self.last = {}

    def due(self, batch):
        key = (batch.status, batch.waiting_reason)
        sent_at, sent_key = self.last.get(batch.id, (0.0, None))
        now = time.monotonic()
        if key != sent_key or now - sent_at >= settings.BATCH_PROGRESS_MIN_INTERVAL_S:
            self.last[batch.id] = (now, key)
            return True
        return False
