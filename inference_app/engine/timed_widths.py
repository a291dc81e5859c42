"""What `auto` timed at one load, kept for the next load on the same machine.

`auto` times each packable shape's kernels against the dense matmul (quantized._packed_width):
on a 2-core AVX2 EPYC that was 19 s of Gemma 3 270M's 28 s load, at every start, and shapes near
a tie came out one way in one load and the other way in the next. The choices are written beside
the model's conversion cache (or in MILLM_TIMINGS_DIR: `location`), under a key of everything the
timing depended on: the CPU (model name and flags), the weights' dtype, torch's version and thread
count, the block kernel's build flags, the code of both kernels and the rule's constants. A load
under the same key reads them and times nothing; any change of those times again. Delete the file
to time again by hand.

What the key cannot hold is the machine's load while it timed: the suite loads the default model
and Gemma while its other worker keeps both cores busy, and their timings, kept beside the cache
`make run` and the bench share, once moved two of the default model's five shapes from 16 packed
rows to 2 (its 8-row step 35 ms instead of 31 on the AVX-512 EPYC). The tests keep theirs in a
folder of their own (tests/conftest.py)."""

import hashlib
import json
import os
from pathlib import Path

import torch

from inference_app.engine import block_kernel, cpu

FILE = "millm-auto-widths.json"
VERSION = 1


def location(folder, directory=None):
    """The file a model converted into `folder` keeps its timings in: beside the conversion, or
    in `directory` (MILLM_TIMINGS_DIR) under the conversion's name."""
    folder = Path(folder)
    return Path(directory) / f"{folder.name}-{FILE}" if directory else folder / FILE


def machine_key(dtype, rule):
    """A digest of what the timings depend on; `rule`: the choosing rule's constants."""
    code = hashlib.sha256()
    for source in (Path(__file__).with_name("quantized.py"), block_kernel.SOURCE):
        code.update(source.read_bytes())
    parts = {
        "version": VERSION, "cpu": cpu.cpu_model(), "flags": sorted(cpu.cpu_flags()), "dtype": str(dtype),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "rule": rule, "code": code.hexdigest(),
        "kernel": block_kernel.build_flags() if block_kernel.extension() is not None else None,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


class TimedWidths:
    """{shape: (form, width)} timed under one key, read from and written to `path` (None: kept nowhere)."""

    def __init__(self, path, key):
        self.path, self.key = path, key
        self.recorded = {name: tuple(choice) for name, choice in self._file().get(key, {}).items()}
        self.reused = set()  # the shapes whose choice was read rather than timed
        self.changed = False

    def get(self, shape):
        """The recorded (form, width) of a (kind, out, in) shape, or None."""
        return self.recorded.get(_name(shape))

    def reuse(self, shape):
        """The shape's recorded choice is what runs (not timed again)."""
        self.reused.add(_name(shape))

    def record(self, shape, form, width):
        self.recorded[_name(shape)] = (form, width)
        self.changed = True

    def write(self):
        """Write what was timed (beside other keys' entries), whole or not at all."""
        if self.path is None or not self.changed:
            return
        entries = self._file()
        entries[self.key] = {name: list(choice) for name, choice in sorted(self.recorded.items())}
        staging = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staging.write_text(json.dumps(entries, indent=1))
            os.replace(staging, self.path)
        except OSError:
            staging.unlink(missing_ok=True)  # a read-only cache: the next load times again

    def _file(self):
        if self.path is None:
            return {}
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return entries if isinstance(entries, dict) else {}


def _name(shape):
    kind, out_features, in_features = shape
    return f"{kind} {out_features}x{in_features}"
