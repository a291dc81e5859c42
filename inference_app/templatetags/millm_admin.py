from django import template

from inference_app.models import Engine

register = template.Library()


@register.inclusion_tag("admin/millm_engines.html")
def engine_health():
    """The engines at a glance, for the admin index."""
    return {"engines": list(Engine.objects.all()[:20])}
