"""Retention of everything a batch leaves: its files (files_app's retention) and, after
BATCH_RETENTION_DAYS, the ended batch itself with its rows; and stored responses after
RESPONSES_RETENTION_DAYS. Run by the engine at start-up and every BATCH_RETENTION_INTERVAL_S, and
by `python manage.py prune`."""

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from batches_app.models import Batch
from files_app import retention as file_retention
from responses_app.models import StoredResponse

log = logging.getLogger("millm.batches")


def prune_batches(now=None):
    """Delete the batches that ended more than BATCH_RETENTION_DAYS ago, their rows with them;
    an unfinished batch is never touched, however old. Returns how many went."""
    moment = (now or timezone.now()) - timedelta(days=settings.BATCH_RETENTION_DAYS)
    deleted = Batch.objects.ended_before(moment).delete_ended()
    if deleted:
        log.info("deleted %d batch(es) that ended before %s", deleted, moment.isoformat())
    return deleted


def run_retention():
    started = time.monotonic()
    outcome = file_retention.run_retention()
    outcome["batches_deleted"] = prune_batches()
    outcome["responses_deleted"] = StoredResponse.objects.purge_expired()
    outcome["seconds"] = round(time.monotonic() - started, 3)
    return outcome
