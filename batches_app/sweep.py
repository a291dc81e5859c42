"""The runner's sweep (between chunks and while idle), a companion of its own: claims of dead
engines released, queued batches say why they wait, unclaimed batches past their window end
expired, and the claims this engine could not release (the database was down) released at last.
"""

import logging

from django.db import close_old_connections

from batches_app import events
from batches_app.models import Batch

log = logging.getLogger("millm.batches")


class Sweep:
    def __init__(self):
        # Claims we could not release: released at the next sweep, or this live engine would hold
        # them forever and the batch would never run again.
        self.unreleased = {}  # batch id -> batch

    def __call__(self):
        close_old_connections()
        self._release_remembered()
        Batch.objects.release_stale_claims()
        for batch in Batch.objects.note_why_waiting():
            events.publish(batch)
        Batch.objects.expire_waiting()

    def anything_to_do(self):
        """Whether a sweep or a claim could find anything: an unfinished batch, or a claim we
        still owe a release. One query; an idle engine asks it at each poll instead of the dozen
        statements of a sweep and its claims (an idle engine polling at 0.2 s used 15% of a core)."""
        close_old_connections()
        return bool(self.unreleased) or Batch.objects.unfinished().exists()

    def release_or_remember(self, batch):
        try:
            close_old_connections()
            batch.release_claim()
        except Exception:
            log.warning("could not release the claim on %s (is the database down?); retrying at the next sweep",
                        batch.pk, exc_info=True)
            self.unreleased[batch.pk] = batch

    def _release_remembered(self):
        for batch_id, batch in list(self.unreleased.items()):
            batch.release_claim()  # raises while the database is still down: the sweep fails, retried
            self.unreleased.pop(batch_id, None)
            log.info("released the claim on %s", batch_id)
