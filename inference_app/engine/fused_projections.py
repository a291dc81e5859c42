"""Sibling projections that read the same input (a layer's query, key and value; its gate and
up) as one packed kernel call, for the lean decode step (lean_step.py).

At one to a few rows a packed projection is small work with a fixed cost: the Python around the
call, the activations' conversion and per-block quantization, the output's allocation and
rounding. At one row a default-model layer's q, k and v took 46 us as three module calls on an
Intel Xeon with AMX and 27 us as one joined call (the kernel itself 16 us); gate and up 64 us
against 56 (bench/FINDINGS.md, "The Intel Xeon with AMX again").

`Siblings` joins runs of consecutive projections packed alike (the same kernel, the same GGML
type for the block kernel or one int4 pack each, the same inputs, no bias) along their output
features: the block kernel's blocks (one row of blocks per feature) and the int4 kernel's packed
weights (one row per feature) are laid end to end in one buffer, and each `PackedLinear` keeps a
view of its own rows, so those bytes are not held twice. The int4 kernel's scales and zeros
([groups, features, 2] bfloat16) are copied for the joined call: its kernel reads a strided view
wrongly, so each projection keeps its own (72 bytes a feature at 576 inputs: 6.3 MiB for the
default model's gate and up). Every output feature is computed alone by either kernel, in the
same order of blocks, so each projection's slice of the joined product equals its own call to
the bit (tests; the lean step's load-time check compares logits to the bit too).

A joined run takes up to its narrowest packed width of rows; above it, and where projections do
not join, each runs as its own module. A change to any of them (an edit unpacks a projection, a
width changes) is seen at the next call, which joins them again.
"""

from functools import partial

import torch

from inference_app.engine.quantized import PackedLinear, as_dtype, packed_product


class Siblings:
    """Called with the input the projections share; returns each one's output, in order. The
    projections are the modules it was made with (the lean step makes it after packing)."""

    def __init__(self, projections):
        self.projections = tuple(projections)
        self.widths = [p.out_features for p in self.projections]
        self._packed = all(isinstance(p, PackedLinear) for p in self.projections) and len(self.projections) > 1
        self._seen = None  # each projection's packed form when `_join` last looked
        # Runs of consecutive projections packed alike: (projections, their widths, the joined call
        # or None, the rows it takes).
        self._runs = [(self.projections, self.widths, None, 0)]

    @property
    def joined(self):
        """Whether any of them run as one call at their packed widths (as of the last call)."""
        return any(kernel is not None for _, _, kernel, _ in self._runs)

    def __call__(self, x):
        if self._packed and not self._unchanged():
            self._join()
        rows = x.numel() // self.projections[0].in_features
        outputs = []
        for projections, widths, kernel, max_rows in self._runs:
            if kernel is not None and rows <= max_rows:
                outputs.extend(as_dtype(kernel(x), x.dtype).split(widths, -1))
            else:
                outputs.extend(projection(x) for projection in projections)
        return tuple(outputs)

    def together(self, x):
        """All their outputs side by side, [..., sum of their out features], from one call; None
        where they do not all run as one (packed differently, or more rows than a packed width)."""
        if self._packed and not self._unchanged():
            self._join()
        [(_, _, kernel, max_rows), *others] = self._runs
        rows = x.numel() // self.projections[0].in_features
        if others or kernel is None or rows > max_rows:
            return None
        return as_dtype(kernel(x), x.dtype)

    def _state(self):
        return [(p.blocks, p.packs, p.max_rows, p.words) for p in self.projections]

    def _unchanged(self):
        seen = self._seen
        return seen is not None and all(
            p.blocks is blocks and p.packs is packs and p.max_rows == max_rows and p.words == words
            for p, (blocks, packs, max_rows, words) in zip(self.projections, seen))

    def _join(self):
        runs = []
        for projection in self.projections:
            if runs and projection.packed and runs[-1][0].packed and _joinable(projection, runs[-1][0]):
                runs[-1].append(projection)
            else:
                runs.append([projection])
        self._runs = [(tuple(run), [p.out_features for p in run], self._join_run(run) if len(run) > 1 else None,
                       min(float("inf") if p.max_rows is None else p.max_rows for p in run)) for run in runs]
        self._seen = self._state()

    @staticmethod
    def _join_run(run):
        """The run's joined call, its packed weights laid end to end as each one's storage."""
        widths = [p.out_features for p in run]
        if run[0].blocks is not None:
            kind = run[0].blocks[0]
            joined = torch.cat([p.blocks[1] for p in run])
            for projection, rows in zip(run, joined.split(widths)):
                projection.blocks = (kind, rows)
            return partial(packed_product, blocks=(kind, joined), packs=None, words=run[0].words)
        joined = torch.cat([p.packs[0][0] for p in run])
        scales = torch.cat([p.packs[0][1] for p in run], dim=1)
        for projection, rows in zip(run, joined.split(widths)):
            projection.packs = [(rows, projection.packs[0][1])]
        return partial(packed_product, blocks=None, packs=[(joined, scales)])


def _joinable(projection, first):
    """Whether `projection` runs packed the way `first` does (both packed): the same kernel (and
    block kernel build), GGML type or single int4 pack, inputs, and no bias."""
    if projection.bias is not None or first.bias is not None or projection.in_features != first.in_features:
        return False
    if first.blocks is not None:
        return (projection.blocks is not None and projection.blocks[0] == first.blocks[0]
                and projection.words == first.words)
    return projection.blocks is None and len(projection.packs) == 1 and len(first.packs) == 1
