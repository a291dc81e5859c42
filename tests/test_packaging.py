"""A non-editable install (`pip install .`, a wheel, a container image) holds the whole server
(issue 46): every app, the Responses API's routes, the admin's page templates and the chat
templates, and Django's checks pass from it alone, outside the checkout."""

import shutil
import subprocess
import sys
import tomllib

from tests.conftest import ROOT

CHECK = """
import importlib, os, sys
import django
from django.core.management import call_command
from django.template.loader import get_template
from django.urls import resolve
django.setup()
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    assert module.__file__.startswith(os.environ["INSTALLED"]), (name, module.__file__)
call_command("check", fail_level="WARNING")
print("responses view", resolve("/v1/responses").func.__module__)
print("admin index", get_template("admin/index.html").origin.name)
from inference_app import chat_templates
print("chat templates", sorted(chat_templates.names()))
"""


def packages():
    """What pyproject.toml installs: its packages.find include patterns, as package names."""
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return [pattern.rstrip("*") for pattern in found["include"]]


def test_every_top_level_package_of_the_server_is_installed():
    on_disk = {path.parent.name for path in ROOT.glob("*/apps.py")} | {"millm_lib", "millm_site"}
    assert on_disk <= set(packages()), on_disk - set(packages())


def test_a_non_editable_install_runs_the_checks_and_routes_responses(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", "var", ".git", "node_modules", "__pycache__",
                                                              "bench", "docs", "tests", "build", "*.egg-info"))
    installed = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-compile",
                            "--quiet", "--target", str(installed), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(installed), "INSTALLED": str(installed),
           "DJANGO_SETTINGS_MODULE": "millm_site.settings", "MILLM_DATA_DIR": str(tmp_path / "data")}
    checked = subprocess.run([sys.executable, "-c", CHECK, *packages()], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "responses view responses_app" in checked.stdout
    assert f"admin index {installed}" in checked.stdout
    assert "'chatml', 'gemma'" in checked.stdout  # the well-known templates' files came along
