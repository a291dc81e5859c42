"""Print the packages that pyproject.toml lists under [tool.millm] no-deps."""

import tomllib
from pathlib import Path

with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as handle:
    print(" ".join(tomllib.load(handle)["tool"]["millm"]["no-deps"]))
