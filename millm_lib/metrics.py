"""The Prometheus registry every app reports on: web's own request figures, and each app's
collector (read at scrape time), registered from the app's config."""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

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
_collectors = set()


def register_collector(collector_class):
    """An app's collector on this registry (from its config), once per process: app loading may
    run again in tests."""
    if collector_class not in _collectors:
        registry.register(collector_class())
        _collectors.add(collector_class)


def render():
    return generate_latest(registry)


def route_label(request):
    match = getattr(request, "resolver_match", None)
    return match.route if match is not None else "unmatched"
