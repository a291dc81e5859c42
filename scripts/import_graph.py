"""The package-level import graph of the project's own packages, and any cycle in it.

    .venv/bin/python scripts/import_graph.py          # edges, one per line, then cycles (none, we hope)

Reads the source (ast), imports nothing: an edge A -> B means a module of package A imports a
module of package B, at module level or inside a function."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("millm_lib", "projects_app", "files_app", "inference_app", "webhooks_app", "responses_app", "batches_app",
            "millm_site")


def imported_packages(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0]


def graph():
    edges = {package: set() for package in PACKAGES}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            edges[package] |= {name for name in imported_packages(path) if name in PACKAGES and name != package}
    return edges


def cycles(edges):
    found = []

    def walk(node, trail):
        for nxt in sorted(edges[node]):
            if nxt == trail[0]:
                found.append(trail + [nxt])
            elif nxt not in trail and nxt > trail[0]:  # each cycle once, from its smallest name
                walk(nxt, trail + [nxt])

    for start in sorted(edges):
        walk(start, [start])
    return found


if __name__ == "__main__":
    edges = graph()
    for package in PACKAGES:
        print(f"{package} -> {', '.join(sorted(edges[package])) or '(nothing)'}")
    found = cycles(edges)
    for cycle in found:
        print("cycle:", " -> ".join(cycle))
    print("no cycle" if not found else f"{len(found)} cycles")
    sys.exit(1 if found else 0)
