"""Reading /metrics as Prometheus would: every sample, by name and labels."""

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(stack):
    """{(sample name, frozenset of labels): value} of everything /metrics shows now."""
    text = httpx.get(stack.web.url + "/metrics", timeout=10).text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples, name, **labels):
    """One sample's value; 0 where there is none."""
    return samples.get((name, frozenset(labels.items())), 0.0)
