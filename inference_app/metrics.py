"""Prometheus metrics: web's own request figures, and the engines' figures read at scrape time."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily

registry = CollectorRegistry()

requests_total = Counter(
    "millm_http_requests_total", "HTTP requests answered", ["route", "method", "status"], registry=registry
)
request_seconds = Histogram(
    "millm_http_request_duration_seconds",
    "Time to answer (to the first byte for streams)",
    ["route"],
    registry=registry,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600),
)


class EngineCollector:
    """Queue depth per engine, read from the heartbeat rows when Prometheus scrapes."""

    def collect(self):
        from inference_app.models import Engine

        waiting = GaugeMetricFamily("millm_queue_waiting", "Interactive requests waiting", labels=["engine", "model"])
        in_flight = GaugeMetricFamily("millm_queue_in_flight", "Slot holders", labels=["engine", "model"])
        alive = GaugeMetricFamily("millm_engine_alive", "1 when the heartbeat is fresh", labels=["engine", "model"])
        sequences = GaugeMetricFamily("millm_engine_sequences_running", "Sequences the step scheduler decodes (0 on a serial engine)",
                                      labels=["engine", "model"])
        waits = SummaryMetricFamily("millm_queue_wait_seconds", "Time interactive requests waited for a seat",
                                    labels=["engine", "model"])
        estimate = GaugeMetricFamily("millm_queue_estimated_wait_seconds",
                                     "The engine's estimate of a new request's wait", labels=["engine", "model"])
        for engine in Engine.objects.all():
            labels = [engine.id, engine.resident_model_id or engine.model_id]
            waiting.add_metric(labels, engine.queue_waiting)
            in_flight.add_metric(labels, engine.in_flight)
            alive.add_metric(labels, 1 if engine.alive else 0)
            sequences.add_metric(labels, engine.sequences_running)
            waits.add_metric(labels, count_value=engine.queue_waits_total, sum_value=engine.queue_wait_seconds_total)
            if engine.estimated_wait_seconds is not None:  # no estimate before the first request ends
                estimate.add_metric(labels, engine.estimated_wait_seconds)
        yield from (waiting, in_flight, alive, sequences, waits, estimate)


registry.register(EngineCollector())
_collectors = set()


def register_collector(collector_class):
    """Another app's collector on this registry (batches_app's, webhooks_app's, from their
    configs: inference_app never imports them), once per process: app loading may run again in
    tests."""
    if collector_class not in _collectors:
        registry.register(collector_class())
        _collectors.add(collector_class)


def render():
    return generate_latest(registry)


def route_label(request):
    match = getattr(request, "resolver_match", None)
    return match.route if match is not None else "unmatched"
