"""Deploy checks clean (issue 26): Django's security, CSRF and clickjacking middleware on every
route, the API's bearer-key routes CSRF-exempt and the admin's staff-session routes not, and the
README's production settings (DJANGO_BEHIND_TLS) passing `manage.py check --deploy`."""

import importlib.util
import os
import re
import secrets
import subprocess
import sys

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.test import Client
from django.urls import URLResolver, get_resolver

from tests.conftest import ROOT
from tests.factories import BatchFactory

from batches_app.models import Batch


def check_deploy(**env):
    environment = {key: value for key, value in os.environ.items() if not key.startswith("DJANGO_")}
    environment.update(DJANGO_SECRET_KEY=secrets.token_urlsafe(50), DJANGO_ALLOWED_HOSTS="millm.example.com", **env)
    return subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120)


def test_the_production_checklist_passes_the_deploy_checks():
    checked = check_deploy(DJANGO_BEHIND_TLS="true")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "System check identified no issues" in checked.stdout


def test_without_tls_settings_the_deploy_checks_warn():
    """The check above can fail: without DJANGO_BEHIND_TLS, plain-HTTP cookies and no HSTS warn."""
    checked = check_deploy()
    assert checked.returncode == 1
    report = checked.stdout + checked.stderr
    assert {"security.W004", "security.W008", "security.W010", "security.W016"} <= set(re.findall(r"security\.W\d+", report))
    for middleware in ("W001", "W002", "W003"):  # the middleware are there
        assert f"security.{middleware}" not in report


def _routes(patterns, prefix=""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _routes(pattern.url_patterns, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern.callback


def test_every_bearer_key_route_is_csrf_exempt_and_the_admin_is_not():
    routes = list(_routes(get_resolver().url_patterns))
    api = [(route, view) for route, view in routes if not route.startswith("admin/")]
    admin = [(route, view) for route, view in routes if route.startswith("admin/")]
    assert len(api) > 30 and len(admin) > 30
    assert [route for route, view in api if not getattr(view, "csrf_exempt", False)] == []
    assert [route for route, view in admin if getattr(view, "csrf_exempt", False)] == []


@pytest.fixture
def staff(db):
    user = User.objects.create_superuser("operator", "operator@example.com", "pw")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


@pytest.fixture(autouse=True)
def storage_in_tmp(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}


@pytest.mark.django_db
def test_the_admin_refuses_a_cross_site_post_and_a_frame(staff):
    batch = BatchFactory(status=Batch.Status.IN_PROGRESS, total=1)
    page = staff.get(f"/admin/batches_app/batch/{quote(batch.pk)}/change/")
    assert page.status_code == 200
    assert page.headers["X-Frame-Options"] == "DENY"
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    (action,) = re.findall(r'formaction="([^"]+)"', page.content.decode())
    # A page elsewhere posting to the cancel button: no token (its site cannot read ours).
    forged = staff.post(action, HTTP_ORIGIN="https://elsewhere.example")
    assert forged.status_code == 403 and b"CSRF" in forged.content
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.IN_PROGRESS
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode()).group(1)
    honest = staff.post(action, {"csrfmiddlewaretoken": token})
    assert honest.status_code == 302
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.CANCELLING


@pytest.mark.django_db
def test_a_bearer_key_route_takes_a_post_without_a_token(staff):
    """The same client, session cookie and all: the API route is exempt and answers for itself."""
    answer = staff.post("/v1/batches", {"endpoint": "/v1/nowhere"}, content_type="application/json")
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] in ("input_file_id", "endpoint")
    assert answer.headers["X-Frame-Options"] == "DENY"


def settings_module_with(monkeypatch, **environment):
    """millm_site/settings.py executed afresh under `environment` (a module of its own: the
    running settings are not touched)."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("settings_under_test", ROOT / "millm_site" / "settings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.django_db
def test_behind_tls_http_is_redirected_and_https_gets_hsts(settings, monkeypatch):
    """What DJANGO_BEHIND_TLS=true itself sets (its block in settings.py), not a copy of it."""
    plain, again = (settings_module_with(monkeypatch, DJANGO_BEHIND_TLS="false") for _ in range(2))
    tls = settings_module_with(monkeypatch, DJANGO_BEHIND_TLS="true")

    def differ(one, other):
        return {name for name in dir(one) if name.isupper() and getattr(one, name) != getattr(other, name, None)}

    changed = differ(tls, plain) - differ(again, plain)  # what the setting changes, not what differs each time
    assert {"SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS", "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE"} <= changed
    for name in changed - {"BEHIND_TLS"}:
        setattr(settings, name, getattr(tls, name))
    assert settings.SESSION_COOKIE_SECURE and settings.CSRF_COOKIE_SECURE
    client = Client()
    plain = client.get("/v1/models")
    assert plain.status_code == 301 and plain.headers["Location"] == "https://testserver/v1/models"
    assert client.get("/api/health").status_code == 200  # probes reach the pod over plain HTTP
    secure = client.get("/v1/models", HTTP_X_FORWARDED_PROTO="https")
    assert secure.status_code == 200
    assert secure.headers["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains; preload"
