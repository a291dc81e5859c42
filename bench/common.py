"""Shared pieces of the benchmarks: Django set-up, the model, timing, and the report."""

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def setup_django():
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")
    import django

    django.setup()


def load_resident(model=None):
    """The model as the engine holds it, through the production loader."""
    from inference_app.catalogue import model_source
    from inference_app.engine.loader import load_model
    from inference_app.engine.runtime import ResidentModel

    return ResidentModel(load_model(model_source(model)))


def interleaved_medians(functions, repeats):
    """Run each function once per round, `repeats` rounds, and return each one's median seconds
    and last result. Interleaving keeps a shared machine's drift out of the ratios."""
    timings = {name: [] for name in functions}
    results = {}
    for _ in range(repeats):
        for name, function in functions.items():
            started = time.perf_counter()
            results[name] = function()
            timings[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in timings.items()}, results


def machine():
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def report(name, rows, figures):
    """Print a table and write bench/results/<name>.json."""
    width = max(len(label) for label, _ in rows)
    print(f"\n{name}")
    for label, value in rows:
        print(f"  {label.ljust(width)}  {value}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"name": name, "machine": machine(), "figures": figures}, indent=2))
    print(f"  (written to {path.relative_to(ROOT)})")
