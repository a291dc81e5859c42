"""The packages' layering (issue 15): millm_lib imports no app, files_app imports only millm_lib,
no app imports the site, and no package-level cycle is left. Read from the source by
`scripts/import_graph.py`, the same script the README names."""

import ast
import importlib.util
import os
import re
import subprocess
import sys

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

APPS = ("projects_app", "files_app", "inference_app", "webhooks_app", "responses_app", "batches_app")


def test_the_shared_package_imports_no_app_and_files_import_only_it_and_projects():
    edges = import_graph.graph()
    assert edges["millm_lib"] == set()
    assert edges["projects_app"] == {"millm_lib"}
    assert edges["files_app"] == {"millm_lib", "projects_app"}


def test_no_app_imports_the_site():
    edges = import_graph.graph()
    assert [app for app in APPS if "millm_site" in edges[app]] == []


def test_no_package_level_cycle_is_left():
    assert import_graph.cycles(import_graph.graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert import_graph.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


# --- who writes state (issue 15, point 2) ---

WRITES = {"update", "delete", "create", "bulk_create", "bulk_update", "get_or_create", "update_or_create", "save", "_move"}
STORAGE = {"storage", "file_storage"}  # file storages save and delete bytes, not rows


def _receiver_names(node):
    """Every name and attribute along a call's receiver chain: `Batch.objects.filter(...).update`
    gives {"Batch", "objects", "filter"}."""
    names = set()
    while True:
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
            node = node.value
        elif isinstance(node, ast.Name):
            names.add(node.id)
            return names
        else:
            return names


def row_writes(path, models):
    """(line, call) of each write whose receiver names one of `models` (or a manager, a related
    manager or a model instance's own save/_move) in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WRITES):
            continue
        receiver = _receiver_names(node.func.value)
        if receiver & STORAGE:
            continue
        if node.func.attr in ("save", "_move") or receiver & (models | {"objects", "rows"}):
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def _sources(package, owner):
    return [path for path in (ROOT / package).rglob("*.py")
            if "migrations" not in path.parts and path != ROOT / package / owner]


def test_no_batch_state_is_written_outside_the_batch_models():
    writes = {str(path.relative_to(ROOT)): row_writes(path, {"Batch", "BatchRow", "batch"})
              for path in _sources("batches_app", "models.py")}
    assert {path: found for path, found in writes.items() if found} == {}


def test_no_engine_model_or_lease_row_is_written_outside_the_inference_models():
    writes = {str(path.relative_to(ROOT)): row_writes(path, {"Engine", "ModelEntry", "Lease", "lease", "entry"})
              for package in ("inference_app", "batches_app")
              for path in _sources(package, "models.py")}
    assert {path: found for path, found in writes.items() if found} == {}


def test_no_webhook_row_is_written_outside_the_webhook_models():
    writes = {str(path.relative_to(ROOT)): row_writes(path, {"WebhookEndpoint", "Delivery", "endpoint", "delivery"})
              for package in ("webhooks_app", "batches_app")
              for path in _sources(package, "models.py")}
    assert {path: found for path, found in writes.items() if found} == {}


def test_the_write_finder_sees_the_writes_it_looks_for(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "Batch.objects.filter(pk=1).update(status='x')\n"
        "batch._move(['a'], 'b')\n"
        "self.batch.rows.filter(line=1).delete()\n"
        "file_storage().delete('name')\n"
        "context.update(a=1)\n"
    )
    assert [line for line, _ in row_writes(source, {"Batch"})] == [1, 2, 3]


# --- the scheduling policy has one home (issue 28, point 2) ---

# Spellings of the policy's decisions as they were written before policy.py held them: none may
# come back outside it. (A decision's number or rule, not a call of the policy's function.)
POLICY_SPELLINGS = {
    "the seats a batch may take": (r"max\(1, [\w.]+ - 1\)",),
    "the pending limit": (r"max_pending \+ [\w.]+ - 1",),
    "the lane mode": (r'"cuda" else "pause"',),
    "the prefill budget": (r"\) > budget",),
    "giving way": (r"interactive_queued > 0",),
    "the next batch": (r'"runs_rows", "created_at"', r"created_at__lt=running_before"),
    "the replica": (r"in_flight\[engine\.pk\]",),
}
POLICY = ROOT / "inference_app" / "engine" / "policy.py"


def policy_duplicates(paths):
    found = []
    for path in paths:
        text = path.read_text()
        for decision, spellings in POLICY_SPELLINGS.items():
            found += [(str(path.relative_to(ROOT)), decision) for spelling in spellings if re.search(spelling, text)]
    return found


def test_no_decision_of_the_scheduling_policy_is_written_outside_it():
    sources = [path for app in APPS for path in (ROOT / app).rglob("*.py") if path != POLICY]
    assert policy_duplicates(sources) == []


def test_the_policy_finder_finds_a_copied_rule():
    copy = ROOT / "var" / "layering-probe.py"
    copy.parent.mkdir(exist_ok=True)
    copy.write_text("room = max(1, self.seats - 1) - len(seated)\n")
    try:
        assert policy_duplicates([copy]) == [("var/layering-probe.py", "the seats a batch may take")]
    finally:
        copy.unlink()


# --- no import circle broken by an import inside a function (issue 28, point 5) ---

def imports_inside_functions(path, package):
    """(function, module) for each import of `package`'s own modules inside a function of `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [(node.name, inner.module) for inner in ast.walk(node)
                      if isinstance(inner, ast.ImportFrom) and (inner.module or "").split(".")[0] == package]
    return found


def test_no_module_imports_its_own_app_inside_a_function():
    # An app's config imports at ready() (the app registry's rule), and a management command
    # imports what it runs when it runs (a web process never loads torch).
    found = [
        (str(path.relative_to(ROOT)), *found)
        for app in (*APPS, "millm_lib") for path in (ROOT / app).rglob("*.py")
        if path.name != "apps.py" and "management" not in path.parts and "migrations" not in path.parts
        for found in imports_inside_functions(path, app)
    ]
    assert found == []


def test_the_inner_import_finder_finds_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def later():\n    from batches_app.models import Batch\n    return Batch\n")
    assert imports_inside_functions(probe, "batches_app") == [("later", "batches_app.models")]


# --- the runner in roles (issue 28, point 1) ---

def class_sizes(paths):
    """(path, class, lines) of every class in `paths`."""
    return [(str(path.relative_to(ROOT)), node.name, node.end_lineno - node.lineno + 1)
            for path in paths for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]


def test_no_class_is_over_300_lines_except_a_models_class_at_400():
    paths = [path for app in (*APPS, "millm_lib") for path in (ROOT / app).rglob("*.py") if "migrations" not in path.parts]
    too_long = [(path, name, lines) for path, name, lines in class_sizes(paths)
                if lines > (400 if path.endswith("models.py") else 300)]
    assert too_long == []


def test_a_leader_and_a_helper_are_objects_not_a_flag_threaded_through_the_runner():
    runner = ast.parse((ROOT / "batches_app" / "runner.py").read_text())
    flagged = [node.name for node in ast.walk(runner) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
               and "leading" in [argument.arg for argument in node.args.args]]
    assert flagged == []
    roles = {node.name for node in ast.parse((ROOT / "batches_app" / "roles.py").read_text()).body
             if isinstance(node, ast.ClassDef)}
    assert roles == {"Leader", "Helper"}


def test_rows_run_on_the_model_through_the_engines_one_call():
    # batches_app hands rows to the engine (run_rows) and never calls a service function or the
    # packing code on a row itself.
    sources = "\n".join(path.read_text() for path in (ROOT / "batches_app").rglob("*.py"))
    assert "services.run(" not in sources and "run_packed(" not in sources
    assert "run_rows(" in (ROOT / "batches_app" / "chunks.py").read_text()


# --- request bodies from one model each (issue 28, point 3) ---

def test_batch_and_webhook_bodies_are_validated_by_their_schema_models_not_by_hand():
    for path in ("batches_app/creation.py", "webhooks_app/views.py"):
        text = (ROOT / path).read_text()
        assert "validate_body(" in text, path
        assert "isinstance(" not in text.replace("if not isinstance(body, dict)", ""), path  # no field checked by hand
        assert "body.get(" not in text and "data.get(" not in text, path  # a body is read through its model
    assert not (ROOT / "webhooks_app" / "requests.py").exists()
    assert "WINDOW = re.compile" not in (ROOT / "batches_app" / "creation.py").read_text()


# --- no app imports another's internals (issue 28, Done when) ---

# What each app offers the others; everything else in it is its own. An engine's scheduler,
# decoder and residency, a batch's runner and roles, a webhook's signing: none is another app's
# business. docs/DESIGN.md, "One room for each behaviour, again", says what each module offers.
PUBLIC = {
    "projects_app": {"models", "access", "admin"},  # admin: the usage readers' registry
    "files_app": {"models", "uploads", "retention"},
    "inference_app": {
        "models", "schemas", "structured", "tools", "catalogue", "gateway", "leases", "events", "backlog",
        "headers", "provenance",  # the generation routes' documented request headers; the provenance headers
        "engine.policy",  # the scheduling policy, read by the runner and the batch models
        "engine.rows",  # the engine's one call for a chunk of rows (and a row's grammar, at validation)
        "engine.seating",  # Seating: the one interface to the model
        "engine.worker",  # the engine process, started by runbatchworker
        "engine.packing", "engine.services",  # a row's measured length and kind, for chunk picking
    },
    "webhooks_app": {"models", "courier"},
    "responses_app": {"models", "requests", "rows"},  # rows: /v1/responses as a batch endpoint
    "batches_app": {"models", "events", "routing"},
    "millm_site": set(),
}


def imported_modules(path):
    """(module, name) for each `from module import name` and `import module` of `path`,
    with `from package import module` read as the module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                as_module = (node.module + "." + alias.name).replace(".", "/")
                is_module = (ROOT / f"{as_module}.py").exists() or (ROOT / as_module / "__init__.py").exists()
                yield (f"{node.module}.{alias.name}", "") if is_module else (node.module, alias.name)
        elif isinstance(node, ast.Import):
            yield from ((alias.name, "") for alias in node.names)


def internal_imports(path, owner):
    """(module, name) for each import by `path` (a module of app `owner`) of another app's module
    that app does not offer, or of a name it keeps private (a leading underscore)."""
    found = []
    for module, name in imported_modules(path):
        app, _, rest = module.partition(".")
        if app in PUBLIC and app != owner and (rest not in PUBLIC[app] or name.startswith("_")):
            found.append((module, name))
    return found


def test_no_app_imports_another_apps_internals():
    found = [(str(path.relative_to(ROOT)), *found) for app in (*APPS, "millm_site")
             for path in (ROOT / app).rglob("*.py") if "migrations" not in path.parts
             for found in internal_imports(path, app)]
    assert found == []


def test_the_internals_finder_finds_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from inference_app.engine.scheduler import StepScheduler\n"
                     "from inference_app.engine import decoding\n"
                     "from inference_app.models import _private\n"
                     "from inference_app.engine import policy\n")
    found = [(module, name) for module, name in internal_imports(probe, "batches_app")]
    assert found == [("inference_app.engine.scheduler", "StepScheduler"), ("inference_app.engine.decoding", ""),
                     ("inference_app.models", "_private")]


def test_a_web_process_loads_its_whole_application_without_torch():
    """Web processes are stateless and many: the ASGI application with every route (the gateway
    and the scheduling policy among them) never imports torch, which only the engine needs."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, django; django.setup(); import millm_site.asgi, millm_site.urls; "
                               "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))"],
        cwd=ROOT, env={**os.environ, "DJANGO_SETTINGS_MODULE": "millm_site.settings"},
        capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip().splitlines()[-1] == "[]", loaded.stdout + loaded.stderr
