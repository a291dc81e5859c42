"""The engines' figures on /metrics, read from their heartbeat rows when Prometheus scrapes
(registered on millm_lib's registry by the app's config)."""

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from inference_app.models import Engine


class EngineCollector:
    """Queue depth per engine, read from the heartbeat rows when Prometheus scrapes."""

    def collect(self):
        waiting = GaugeMetricFamily("millm_queue_waiting", "Interactive requests waiting", labels=["engine", "model"])
        in_flight = GaugeMetricFamily("millm_queue_in_flight", "Slot holders", labels=["engine", "model"])
        alive = GaugeMetricFamily("millm_engine_alive", "1 when the heartbeat is fresh", labels=["engine", "model"])
        sequences = GaugeMetricFamily("millm_engine_sequences_running", "Sequences the step scheduler decodes (0 on a serial engine)",
                                      labels=["engine", "model"])
        waits = SummaryMetricFamily("millm_queue_wait_seconds", "Time interactive requests waited for a seat",
                                    labels=["engine", "model"])
        estimate = GaugeMetricFamily("millm_queue_estimated_wait_seconds",
                                     "The engine's estimate of a new request's wait", labels=["engine", "model"])
        reused = CounterMetricFamily("millm_prefix_tokens_reused", "Prompt tokens served from a cached prefix, "
                                     "not run again (since the engine process started)", labels=["engine", "model"])
        held = GaugeMetricFamily("millm_prefix_cache_bytes", "Bytes of shared prefixes the engine's prefix cache "
                                 "holds (at most MILLM_PREFIX_CACHE_MB)", labels=["engine", "model"])
        for engine in Engine.objects.all():
            labels = [engine.id, engine.resident_model_id or engine.model_id]
            waiting.add_metric(labels, engine.queue_waiting)
            in_flight.add_metric(labels, engine.in_flight)
            alive.add_metric(labels, 1 if engine.alive else 0)
            sequences.add_metric(labels, engine.sequences_running)
            waits.add_metric(labels, count_value=engine.queue_waits_total, sum_value=engine.queue_wait_seconds_total)
            reused.add_metric(labels, engine.prefix_tokens_reused_total)
            held.add_metric(labels, engine.prefix_cache_bytes)
            if engine.estimated_wait_seconds is not None:  # no estimate before the first request ends
                estimate.add_metric(labels, engine.estimated_wait_seconds)
        yield from (waiting, in_flight, alive, sequences, waits, estimate, reused, held)
