"""Prometheus series about batches (SPEC 7: rows run and batch states), read from PostgreSQL when
Prometheus scrapes, so any web process answers the same figures. Registered on inference_app's
registry by this app's config: inference_app never imports batches_app. Gauges, not counters:
retention deletes ended batches and their rows, so these figures may go down."""

from django.db.models import Count, Sum
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from batches_app.models import Batch, BatchRow
from batches_app.usage import usage_by_project


def _families():
    return {
        "batches": GaugeMetricFamily("millm_batches", "Batches in the database, by status", labels=["status"]),
        "rows": GaugeMetricFamily(
            "millm_batch_rows", "Rows of the batches in the database, by endpoint and outcome (pending: not yet run)",
            labels=["endpoint", "outcome"],
        ),
        "tokens": GaugeMetricFamily(
            "millm_batch_tokens", "Tokens of the batches in the database: prompt (input), of them a cached "
                                  "prefix's (cached, prefix_reuse), and generated (output)",
            labels=["kind"],
        ),
        "rate": GaugeMetricFamily(
            "millm_batch_rows_per_second", "Rows recorded per second since each running batch started running",
            labels=["batch", "model"],
        ),
        "backlog": GaugeMetricFamily(
            "millm_batch_backlog_rows",
            "Valid rows not yet run of the active batches, by model and batch status (each row once, whichever "
            "replicas serve its model; a validating batch's model is empty until validation names it)",
            labels=["model", "status"],
        ),
        "usage": GaugeMetricFamily(
            "millm_project_usage", "Each project's use of its quotas: active batches, rows queued in them, stored file bytes",
            labels=["project", "quota"],
        ),
    }


class BatchCollector:
    def describe(self):
        # Names only: registering must not query the database (it happens at app loading).
        return list(_families().values())

    def collect(self):
        families = _families()
        by_status = dict(Batch.objects.order_by().values_list("status").annotate(n=Count("id")))
        for status in Batch.Status.values:
            families["batches"].add_metric([status], by_status.get(status, 0))
        counted = BatchRow.objects.order_by().values_list("batch__endpoint", "outcome").annotate(n=Count("id"))
        for endpoint, outcome, count in counted:
            families["rows"].add_metric([endpoint, outcome], count)
        tokens = Batch.objects.aggregate(input=Sum("input_tokens"), cached=Sum("cached_tokens"), output=Sum("output_tokens"))
        for kind in ("input", "cached", "output"):
            families["tokens"].add_metric([kind], tokens[kind] or 0)
        now = timezone.now()
        running = Batch.objects.filter(status=Batch.Status.IN_PROGRESS, in_progress_at__isnull=False).only(
            "id", "model", "status", "completed", "failed", "in_progress_at")
        for batch in running:
            families["rate"].add_metric([batch.id, batch.model or ""], batch.rows_per_second(now))
        for (model, status), rows in BatchRow.objects.backlog().items():
            families["backlog"].add_metric([model, status], rows)
        for project, figures in usage_by_project().items():
            for quota, value in figures.items():
                families["usage"].add_metric([project, quota], value)
        yield from families.values()
