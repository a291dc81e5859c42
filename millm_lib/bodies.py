"""Request bodies validated by the pydantic models that also document them (/api/schema/), and
the one mapper from pydantic's errors to the API's refusal (an `ApiError` naming the field).

A body model says how each of its refusals reads:
- `REFUSALS`: {field path: (param, template)}; the longest prefix of an error's path picks it
  (`#` in a path stands for any list index; a param of None is the error's own path). A template
  is a string, or {pydantic error type: string, "": the rest}. It is formatted with `got` (the
  value sent, shortened), `length` (its length, where it has one), `param`, and the model's
  limits (`LIMITS`);
- a field that was not sent reads "<field> is required", unless its template names "missing";
- `UNKNOWN`: the template of a field the body does not take (`name` is the field, `known` the
  fields it takes);
- a validator with a message of its own raises `refused(message)`: the message is used as it is.

The first refusal wins: an unknown field first (as a body is read: what it is before what it
holds), then the fields in the model's order.
"""

import json

from pydantic import ValidationError

from millm_lib.errors import ApiError


class Refused(ValueError):
    """Raised by a validator with the API's own message for its refusal."""


def refused(message):
    """The error a validator raises with the API's own message for it."""
    return Refused(message)


def shown(value):
    """A value sent, as a refusal quotes it (80 characters at most)."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_body(model, body, code, status=400, context=None):
    """`body` (a parsed JSON value) as an instance of `model`, or the ApiError `code` naming the
    first refused field. A body that is not an object is refused as a whole (no param)."""
    if not isinstance(body, dict):
        raise ApiError(status, code, "The body must be a JSON object", param=None)
    try:
        return model.model_validate(body, context=context)
    except ValidationError as error:
        raise refusal(model, error, code, status, body) from None


def refusal(model, error, code, status, body):
    issues = error.errors(include_url=False)
    issue = next((item for item in issues if item["type"] == "extra_forbidden"), issues[0])
    path = tuple(str(part) for part in issue["loc"])
    if issue["type"] == "extra_forbidden":
        known = ", ".join(sorted(name for name in model.model_fields))
        return ApiError(status, code, model.UNKNOWN.format(name=path[-1], known=known), param=".".join(path))
    if isinstance((issue.get("ctx") or {}).get("error"), Refused):
        return ApiError(status, code, str(issue["ctx"]["error"]), param=".".join(path))
    refusals = {tuple(key.split(".")): value for key, value in model.REFUSALS.items()}
    for length in range(len(path), 0, -1):
        prefix = path[:length]
        key = next((key for key in refusals if len(key) == length and all(
            part == "#" and step.isdigit() or part == step for part, step in zip(key, prefix))), None)
        if key is None:
            continue
        param, template = refusals[key]
        param = param or ".".join(prefix)
        if isinstance(template, dict):
            template = template.get(issue["type"]) or (None if issue["type"] == "missing" else template[""])
        if template is None:
            return ApiError(status, code, f"{param} is required", param=param)
        sent = _sent(body, prefix)
        text = template.format(got=shown(sent), length=len(sent) if hasattr(sent, "__len__") else None, param=param,
                               **getattr(model, "LIMITS", {}))
        return ApiError(status, code, text, param=param)
    param = ".".join(path)
    if issue["type"] == "missing":
        return ApiError(status, code, f"{param} is required", param=param)
    return ApiError(status, code, f"{param}: {issue['msg']}", param=param)


def _sent(body, path):
    value = body
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value
