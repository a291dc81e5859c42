"""Settings come from the environment and a bad value stops start-up naming the variable."""

import os
import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

from millm_site.env import envbool, envfloat, envint
from tests.conftest import ROOT


def test_helpers_read_typed_values(monkeypatch):
    monkeypatch.setenv("X_INT", "1_000")
    monkeypatch.setenv("X_BOOL", "Yes")
    monkeypatch.setenv("X_FLOAT", "0.5")
    assert envint("X_INT", 1) == 1000
    assert envbool("X_BOOL", False) is True
    assert envfloat("X_FLOAT", 1.0) == 0.5
    assert envint("X_UNSET", 7) == 7


@pytest.mark.parametrize(
    "helper,value,message",
    [(envint, "ten", "whole number"), (envbool, "perhaps", "true or false"), (envfloat, "nan", "finite")],
)
def test_helpers_refuse_bad_values_naming_the_variable(monkeypatch, helper, value, message):
    monkeypatch.setenv("X_BAD", value)
    with pytest.raises(ImproperlyConfigured, match=f"X_BAD.*{message}|{message}.*X_BAD|X_BAD"):
        helper("X_BAD", 1)


def test_a_bound_is_enforced(monkeypatch):
    monkeypatch.setenv("X_LOW", "0")
    with pytest.raises(ImproperlyConfigured, match="X_LOW must be at least 1"):
        envint("X_LOW", 5, minimum=1)


@pytest.mark.parametrize(
    "name,value",
    [("MAX_PENDING_REQUESTS", "lots"), ("DATABASE_URL", "mysql://root@127.0.0.1/millm"), ("MILLM_STORAGE", "ftp")],
)
def test_start_up_stops_on_a_bad_value(name, value):
    env = {**os.environ, name: value}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert name in result.stderr
