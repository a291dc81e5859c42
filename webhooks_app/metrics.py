"""/metrics' webhook series, read from the outbox when Prometheus scrapes (every web process
answers the same); registered on inference_app's registry by this app's config."""

from django.db.models import Count, Sum
from prometheus_client.core import GaugeMetricFamily

from webhooks_app.models import Delivery


class WebhookCollector:
    def describe(self):
        # Names only: registering must not query the database (it happens at app loading).
        return list(self._families().values())

    def collect(self):
        families = self._families()
        counted = {row["status"]: row for row in Delivery.objects.order_by().values("status").annotate(n=Count("pk"), tries=Sum("attempts"))}
        for status in Delivery.Status.values:
            row = counted.get(status, {"n": 0, "tries": 0})
            families["deliveries"].add_metric([status], row["n"])
            families["attempts"].add_metric([status], row["tries"] or 0)
        yield from families.values()

    @staticmethod
    def _families():
        return {
            "deliveries": GaugeMetricFamily("millm_webhook_deliveries", "Webhook deliveries in the outbox, by status",
                                            labels=["status"]),
            "attempts": GaugeMetricFamily("millm_webhook_attempts", "Attempts made for those deliveries, by status",
                                          labels=["status"]),
        }
