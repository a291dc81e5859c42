"""The engine: the one process that owns the resident model and the admission slot.

Only `runbatchworker` (and tests) import this package, except its `policy` module (no torch),
which the gateway reads to route requests: web processes never import torch.
"""
