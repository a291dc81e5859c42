"""Typed readers for settings from the environment.

Each raises ImproperlyConfigured naming the variable, so a bad value stops start-up instead of
surfacing later as a confusing failure.
"""

import os

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _raw(name):
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def envstr(name, default=None):
    value = _raw(name)
    return default if value is None else value


def envint(name, default, minimum=None, maximum=None):
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value.replace("_", ""))
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a whole number, got {value!r}") from None
    _check_range(name, number, minimum, maximum)
    return number


def envfloat(name, default, minimum=None, maximum=None):
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {value!r}") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ImproperlyConfigured(f"{name} must be a finite number, got {value!r}")
    _check_range(name, number, minimum, maximum)
    return number


def envbool(name, default):
    value = _raw(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, got {value!r}")


def envlist(name):
    value = _raw(name)
    if value is None:
        return []
    return [item.strip() for item in value.split(",") if item.strip()]


def envchoice(name, default, choices):
    value = _raw(name)
    if value is None:
        return default
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _check_range(name, number, minimum, maximum):
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"{name} must be at least {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"{name} must be at most {maximum}, got {number}")
