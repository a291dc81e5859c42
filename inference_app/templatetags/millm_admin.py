from django import template

from inference_app import backlog
from inference_app.models import Engine

register = template.Library()


@register.inclusion_tag("admin/millm_engines.html")
def engine_health():
    """The engines at a glance, and the batch backlog by model, for the admin index."""
    rows = backlog.by_model()
    return {"engines": list(Engine.objects.all()[:20]), "backlog_total": None if rows is None else sum(rows.values()),
            "backlog": sorted((model or "(validating)", count) for model, count in (rows or {}).items())}
