"""The engine: the one process that owns the resident model and the admission slot.

Only `runbatchworker` (and tests) import this package; web processes never import torch.
"""
