"""The server runs on a server-only install (issue 26): every package its code imports is in
`pyproject.toml`'s `dependencies` (not only an extra's, nor a dependency of another package),
as deptry reads it, configured in `[tool.deptry]`; and every module of the server imports."""

import importlib
import pkgutil
import re
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import ROOT

# What a non-editable install holds (pyproject's packages.find; tests/test_packaging.py checks
# that every app is there), so a new app is checked here without being named again.
SERVER_PACKAGES = tuple(pattern.rstrip("*") for pattern in tomllib.loads((ROOT / "pyproject.toml").read_text())
                        ["tool"]["setuptools"]["packages"]["find"]["include"])


def deptry(config=None):
    args = [sys.executable, "-m", "deptry", ".", "--no-ansi"]
    if config is not None:
        args += ["--config", str(config)]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_server_imports_only_what_dependencies_declare():
    checked = deptry()
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_check_fails_when_a_package_the_server_imports_is_only_in_an_extra(tmp_path):
    """httpx (the webhook courier's client) out of `dependencies`, still in the test extra: refused."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = '    "httpx>=0.27,<1",\n'
    assert pyproject.count(declared) == 1
    without = tmp_path / "pyproject.toml"
    without.write_text(pyproject.replace(declared, "").replace(
        '    "pytest>=8,<10",\n', '    "pytest>=8,<10",\n' + declared))
    checked = deptry(without)
    assert checked.returncode == 1
    report = checked.stdout + checked.stderr
    assert re.search(r"webhooks_app/targets\.py:\d+:\d+: DEP004 .httpx. imported but declared as a dev dependency", report), report


def _modules():
    for package in SERVER_PACKAGES:
        yield package
        for module in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
            yield module.name


@pytest.mark.parametrize("package", SERVER_PACKAGES)
def test_every_module_of_the_server_imports(package):
    names = [name for name in _modules() if name == package or name.startswith(package + ".")]
    assert len(names) > 2
    for name in names:
        importlib.import_module(name)
