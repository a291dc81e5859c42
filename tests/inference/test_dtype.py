"""The dtype rule (SPEC 7a): `auto` is bfloat16 on CUDA and on a CPU with native bfloat16, float32
elsewhere; a named dtype is always that dtype."""

import pytest
import torch

from inference_app.engine.loader import cpu_flags, pick_dtype

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


def test_auto_reads_this_machines_flags(settings):
    settings.MILLM_DTYPE = "auto"
    flags = cpu_flags()
    assert isinstance(flags, frozenset)
    native = bool({"avx512_bf16", "amx_bf16"} & flags)
    assert pick_dtype(CPU) is (torch.bfloat16 if native else torch.float32)
