"""The webhook endpoints API's checks, each refusal a 400 naming its field, the limit and what
was sent (nothing is stored when one fails)."""

import json

from millm_lib.errors import ApiError
from webhooks_app.models import EVENT_TYPES, NAME_MAX
from webhooks_app.targets import url_problem

CODE = "invalid_webhook_request"
FIELDS = ("name", "url", "event_types")


def refuse(message, param):
    return ApiError(400, CODE, message, param=param)


def endpoint_fields(body, partial=False):
    """The endpoint fields of a create (all required) or an update (`partial`: any of them)."""
    _object(body)
    unknown = [key for key in body if key not in FIELDS]
    if unknown:
        raise refuse(f"Unknown field '{unknown[0]}'; a webhook endpoint takes {', '.join(FIELDS)}", unknown[0])
    fields = {}
    for name, check in (("name", _name), ("url", _url), ("event_types", _event_types)):
        if body.get(name) is None:
            if not partial:
                raise refuse(f"{name} is required", name)
            continue
        fields[name] = check(body[name])
    return fields


def test_event_type(body):
    _object(body)
    unknown = [key for key in body if key != "event_type"]
    if unknown:
        raise refuse(f"Unknown field '{unknown[0]}'; a test takes event_type", unknown[0])
    return _event_type(body.get("event_type"), "event_type")


def keep_old_secret(body):
    _object(body)
    unknown = [key for key in body if key != "keep_old_secret_active_for_24_hours"]
    if unknown:
        raise refuse(f"Unknown field '{unknown[0]}'; a rotation takes keep_old_secret_active_for_24_hours", unknown[0])
    keep = body.get("keep_old_secret_active_for_24_hours")
    if keep is None:
        return False
    if not isinstance(keep, bool):
        raise refuse(f"keep_old_secret_active_for_24_hours must be true or false, got {_shown(keep)}",
                     "keep_old_secret_active_for_24_hours")
    return keep


def _object(body):
    if not isinstance(body, dict):
        raise refuse("The body must be a JSON object", None)


def _name(value):
    if not isinstance(value, str) or not value.strip():
        raise refuse(f"name must be a non-empty string, got {_shown(value)}", "name")
    if len(value) > NAME_MAX:
        raise refuse(f"name is {len(value)} characters; the limit is {NAME_MAX}", "name")
    return value


def _url(value):
    problem = url_problem(value)
    if problem is not None:
        raise refuse(problem if isinstance(value, str) else f"url must be an http(s) URL, got {_shown(value)}", "url")
    return value


def _event_types(value):
    if not isinstance(value, list) or not value:
        raise refuse(f"event_types must be a non-empty list of event types, got {_shown(value)}", "event_types")
    chosen = []
    for index, item in enumerate(value):
        event_type = _event_type(item, f"event_types.{index}")
        if event_type not in chosen:
            chosen.append(event_type)
    return chosen


def _event_type(value, param):
    if value not in EVENT_TYPES:
        raise refuse(f"{param} is {_shown(value)}: this server sends only {', '.join(EVENT_TYPES)}", param)
    return value


def _shown(value):
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
