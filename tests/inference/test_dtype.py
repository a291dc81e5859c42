"""The dtype rule (SPEC 7a): `auto` is bfloat16 on CUDA and on a CPU with native bfloat16, float32
elsewhere; a named dtype is always that dtype."""

import subprocess
from pathlib import Path

import pytest
import torch

from inference_app.engine.loader import cpu_flags, flags_of, pick_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}, torch.bfloat16),  # this machine's kind: EPYC with AVX-512 BF16
    ({"avx2", "amx_tile", "amx_bf16"}, torch.bfloat16),  # Sapphire Rapids' AMX
    ({"avx2", "avx512f", "avx512_vnni"}, torch.float32),  # AVX-512 without its bfloat16 instructions
    ({"fp", "asimd"}, torch.float32),  # elsewhere
    (set(), torch.float32),  # no /proc/cpuinfo
])
def test_auto_on_a_cpu_is_bfloat16_only_with_native_bfloat16(flags, expected):
    assert pick_dtype(CPU, "auto", flags) is expected


def test_auto_on_cuda_is_bfloat16_and_a_named_dtype_is_that_dtype():
    assert pick_dtype(CUDA, "auto", set()) is torch.bfloat16
    assert pick_dtype(CPU, "float32", {"avx512_bf16"}) is torch.float32
    assert pick_dtype(CUDA, "float32") is torch.float32
    assert pick_dtype(CPU, "bfloat16", set()) is torch.bfloat16


RECORDED = Path(__file__).parent / "cpuinfo"


@pytest.mark.parametrize("recorded,expected", [
    ("intel_xeon_amx.txt", torch.bfloat16),  # AMX (and a "vmx flags" line after the flags)
    ("amd_epyc_avx512_bf16.txt", torch.bfloat16),  # recorded on this project's AMD EPYC machine
    ("amd_epyc_without_avx512.txt", torch.float32),
    ("empty.txt", torch.float32),
])
def test_auto_reads_recorded_cpuinfo_texts(recorded, expected):
    flags = flags_of((RECORDED / recorded).read_text())
    assert pick_dtype(CPU, "auto", flags) is expected
    if recorded != "empty.txt":
        assert {"sse2", "avx2"} <= flags and len(flags) > 50  # the whole flags line, not a part of it
    assert ("vmx" not in flags) and ("preemption_timer" not in flags)  # "vmx flags" is another line


def test_auto_reads_this_machines_flags(settings):
    """Checked against grep's reading of /proc/cpuinfo, not the code's own parse."""
    settings.MILLM_DTYPE = "auto"
    found = subprocess.run(["grep", "-m1", "-owE", "avx512_bf16|amx_bf16", "/proc/cpuinfo"], capture_output=True,
                           text=True).stdout.split()
    assert pick_dtype(CPU) is (torch.bfloat16 if found else torch.float32)
    assert set(found) <= cpu_flags()
