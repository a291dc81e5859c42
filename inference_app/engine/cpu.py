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


def flags_of(cpuinfo):
    """The first processor's `flags` line of a /proc/cpuinfo text, as a set (empty if none)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()
