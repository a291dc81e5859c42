"""Sibling projections that read the same input (a layer's query, key and value; its gate and
up) as one packed kernel call, for the lean decode step (lean_step.py).

At one to a few rows a packed projection is small work with a fixed cost: the Python around the
call, the activations' conversion and per-block quantization, the output's allocation and
rounding. A default-model layer's q, k and v took 46 us as three calls on an Intel Xeon and
16 us as one (bench/FINDINGS.md, "One packed call for sibling projections").

`Siblings` joins the projections' packed weights along their output features: the block kernel's
blocks (one row of blocks per feature) and the int4 kernel's packed weights (one row per feature)
are laid end to end in one buffer, and each `PackedLinear` keeps a view of its own rows, so the
packed bytes are not held twice (the int4 kernel's scales, laid out per group across the
features, are copied: a few KiB a projection). Every output feature is computed alone by either
kernel, in the same order of blocks, so each projection's slice of the joined product equals its
own call to the bit (tests; the lean step's load-time check compares logits to the bit too).

They join only where they run the same way: every one packed, with the same kernel, the same
GGML type (block kernel) or one int4 pack each, the same inputs, the same widths, no bias. Above
their packed width, or where they do not join, each runs as its own module. A change to any of
them (an edit unpacks a projection) is seen at the next call, which joins them again or runs
them apart.
"""

import torch

from inference_app.engine import block_kernel
from inference_app.engine.quantized import GROUP, PackedLinear


class Siblings:
    """Called with the input the projections share; returns each one's output, in order. The
    projections are the modules it was made with (the lean step makes it after packing)."""

    def __init__(self, projections):
        self.projections = tuple(projections)
        self.widths = [p.out_features for p in self.projections]
        self._packed = all(isinstance(p, PackedLinear) for p in self.projections) and len(self.projections) > 1
        self._seen = None  # each projection's packed form when `_join` last looked
        self._kernel = None  # the joined call: [rows, in] -> [rows, sum of widths]

    @property
    def joined(self):
        """Whether they run as one call at their packed widths (as of the last call)."""
        return self._kernel is not None

    def __call__(self, x):
        together = self.together(x)
        if together is None:
            return tuple(projection(x) for projection in self.projections)
        return together.split(self.widths, -1)

    def together(self, x):
        """Their outputs side by side, [..., sum of their out features], from one call; None
        where they run apart (not joined, or more rows than their packed width)."""
        if self._packed and not self._unchanged():
            self._join()
        if self._kernel is None:
            return None
        first = self.projections[0]
        rows = x.numel() // first.in_features
        if first.max_rows is not None and rows > first.max_rows:
            return None
        return self._kernel(x.reshape(rows, first.in_features)).to(x.dtype).view(*x.shape[:-1], -1)

    def _state(self):
        return [(p.blocks, p.packs, p.max_rows) for p in self.projections]

    def _unchanged(self):
        seen = self._seen
        return seen is not None and all(
            p.blocks is blocks and p.packs is packs and p.max_rows == max_rows
            for p, (blocks, packs, max_rows) in zip(self.projections, seen))

    def _join(self):
        projections = self.projections
        self._kernel = None
        if all(_joinable(p, projections[0]) for p in projections):
            self._kernel = self._join_blocks() if projections[0].blocks is not None else self._join_int4()
        self._seen = self._state()

    def _join_blocks(self):
        kind = self.projections[0].blocks[0]
        joined = torch.cat([p.blocks[1] for p in self.projections])
        for projection, rows in zip(self.projections, joined.split(self.widths)):
            projection.blocks = (kind, rows)
        return lambda x: block_kernel.block_mm(x, joined, kind)

    def _join_int4(self):
        joined = torch.cat([p.packs[0][0] for p in self.projections])
        scales = torch.cat([p.packs[0][1] for p in self.projections], dim=1)
        for projection, rows in zip(self.projections, joined.split(self.widths)):
            projection.packs = [(rows, projection.packs[0][1])]
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), joined, GROUP, scales)


def _joinable(projection, first):
    if not projection.packed or projection.bias is not None:
        return False
    if projection.in_features != first.in_features or projection.max_rows != first.max_rows:
        return False
    if first.blocks is not None:
        return projection.blocks is not None and projection.blocks[0] == first.blocks[0]
    return projection.blocks is None and len(projection.packs) == 1 and len(first.packs) == 1
