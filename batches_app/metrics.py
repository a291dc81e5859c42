"""Prometheus series about batches (SPEC 7: rows run and batch states), read from PostgreSQL when
Prometheus scrapes, so any web process answers the same figures. Registered on inference_app's
registry by this app's config: inference_app never imports batches_app."""

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily

from batches_app.models import Batch, BatchRow


def _families():
    batches = GaugeMetricFamily("millm_batches", "Batches in the database, by status", labels=["status"])
    rows = GaugeMetricFamily(
        "millm_batch_rows", "Rows of the batches in the database, by outcome (pending: not yet run)", labels=["outcome"]
    )
    return batches, rows


class BatchCollector:
    def describe(self):
        # Names only: registering must not query the database (it happens at app loading).
        return list(_families())

    def collect(self):
        batches, rows = _families()
        by_status = dict(Batch.objects.order_by().values_list("status").annotate(n=Count("id")))
        for status in Batch.Status.values:
            batches.add_metric([status], by_status.get(status, 0))
        by_outcome = dict(BatchRow.objects.order_by().values_list("outcome").annotate(n=Count("id")))
        for outcome in BatchRow.Outcome.values:
            rows.add_metric([outcome], by_outcome.get(outcome, 0))
        yield batches
        yield rows


_registered = False


def register(registry):
    """Once per process (app loading may run again in tests)."""
    global _registered
    if not _registered:
        registry.register(BatchCollector())
        _registered = True
