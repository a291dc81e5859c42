"""The CPU's feature flags, as Linux lists them: what the dtype (loader.py) and the block
kernel (block_kernel.py) decide by."""

import functools
from pathlib import Path


@functools.cache
def cpu_flags():
    """The CPU's feature flags as Linux lists them (none where there is no /proc/cpuinfo)."""
    try:
        return flags_of(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


@functools.cache
def cpu_model():
    """The first processor's `model name` (empty where there is none)."""
    try:
        return _field(Path("/proc/cpuinfo").read_text(), "model name")
    except OSError:
        return ""


def _field(cpuinfo, wanted):
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == wanted:
            return value.strip()
    return ""


def flags_of(cpuinfo):
    """The first processor's `flags` line of a /proc/cpuinfo text, as a set (empty if none)."""
    return frozenset(_field(cpuinfo, "flags").split())
