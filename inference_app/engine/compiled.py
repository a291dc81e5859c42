"""A compiled decode step (MILLM_COMPILE=decode, SPEC 7a): `torch.compile` of the model's forward
pass for the scheduler's decode steps, with its shapes bucketed so that steady traffic never
compiles again.

A decode step's input has two sizes that change all the time: the rows (live sequences) and the
cache columns (the longest row's length so far). Compiled with dynamic shapes, each is a symbol,
except that torch specialises a size of 1, and that a packed projection's width rule (packed up
to `m` rows, dense above: quantized.py) is a branch on the rows. So the buckets of rows are: one;
two or more; and above each packed width `m` (`bucket_widths`). The columns are kept at two or
more (`CompiledStep.min_columns`: a one-token prompt's cache gets a masked padding column, which
the row never reads). `warm` compiles every bucket at load, times it, and logs it; after that a
step that compiles again is a shape outside the buckets, counted (`recompiles`) and logged as a
warning. Prefills, scoring and embeddings stay eager: their shapes are
the prompts' own.

An edit that unpacks a projection (weights.py) changes the modules the graph was traced over, so
the next step compiles once more. Under float32 the compiled step's tokens may differ from the
eager step's where the compiler orders a reduction differently; MILLM_COMPILE=off (the default)
keeps every exactness promise as stated.
"""

import logging
import time

import torch

from inference_app.engine import quantized
from inference_app.engine.decoding import BatchedDecoder

log = logging.getLogger("millm.engine")

# The first prompt `warm` decodes: its length is no size the model's code compares with a
# constant, so no length is specialised (each prompt after it is two tokens longer).
_WARM_LENGTH = 7


def bucket_widths(model):
    """One width in each bucket of rows: one row; two or more; and where a packed projection
    runs packed up to `m` rows and dense above (quantized.py), the rows above `m`."""
    return sorted({1, 2} | {bound + 1 for bound in quantized.width_bounds(model)})


class CompiledStep:
    """The model's forward pass, compiled for decode steps; `compiles` counts the steps that had
    to compile (a backend may be handed more than one graph for one of them)."""

    min_columns = 2  # the fewest cache columns a step may see: torch specialises a size of 1

    def __init__(self, model, backend="inductor"):
        self.model = model
        self.backend = backend
        self.compiles = 0
        self.warm_compiles = None  # the count once `warm` is done: more is a recompile
        self.compile_seconds = 0.0
        self._graphs = 0  # graphs handed to the backend (this thread only: the model thread)
        self._forward = torch.compile(model.forward, dynamic=True, backend=self._count_and_compile)

    def _count_and_compile(self, graph, example_inputs):
        self._graphs += 1
        # torch._dynamo is loaded by torch.compile (in __init__), not imported here: importing
        # it takes 3 s, which an engine that never compiles should not pay at start.
        return torch._dynamo.lookup_backend(self.backend)(graph, example_inputs)

    @property
    def recompiles(self):
        """Steps that compiled after `warm`: shapes outside the buckets (or an edited model)."""
        return 0 if self.warm_compiles is None else self.compiles - self.warm_compiles

    def __call__(self, **inputs):
        before = self._graphs
        out = self._forward(**inputs)
        if self._graphs != before:
            self.compiles += 1
            if self.warm_compiles is not None:
                log.warning("the decode step compiled again (rows %d, columns %d): a shape outside its buckets, "
                            "or an edited model", *inputs["attention_mask"].shape)
        return out

    def warm(self, runtime):
        """Compile both buckets now (one row, then two), so no request waits for a compile."""
        started = time.monotonic()
        decoder = BatchedDecoder(runtime)
        widths = bucket_widths(self.model)
        for width in widths:
            while decoder.rows < width:
                length = _WARM_LENGTH + 2 * decoder.rows
                cache, _ = decoder.prefill([0] * length)
                decoder.admit(cache, length)
            decoder.step([0] * width)
        self.compile_seconds = time.monotonic() - started
        self.warm_compiles = self.compiles
        log.info("compiled the decode step in %.1f s (%d shape buckets, from %s rows; backend %s)",
                 self.compile_seconds, self.compiles, ", ".join(map(str, widths)), self.backend)
        return self
