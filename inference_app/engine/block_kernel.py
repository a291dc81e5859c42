"""A GGUF tensor's own blocks times activations, as llama.cpp's CPU backend computes it
(kernels/block_dot.cpp), but for the activations' rounding: to 16 bits per block of 32 (two
int8 each, the value and its remainder, where llama.cpp rounds to one), the weight's integers
met in AVX-512 VNNI's `vpdpbusd` where the CPU has it (the K-quants' sub-blocks two at a time
where it has AVX-512's byte forms too, and there the 32-weight kinds' blocks as 32 words in
one 512-bit word multiply-add), else in AVX2's word multiply-add, each activation one 16-bit
word, the weight's integers widened to words. It reads the
file's bytes (Q4_1: 0.625 bytes a weight; Q8_0: 1.06, once, where the int4 kernel reads two
halves; Q6_K, which no int4 kernel takes, 0.82) at any number of rows.

Built once per machine and source by torch's C++ extension tooling (`make kernels` builds it;
an engine that finds it unbuilt builds it at load), in a folder of torch's extensions folder
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`) named by a digest of the source,
the flags and the torch and Python versions, from a copy of the source kept there: every
checkout of the same source shares one build (torch's own keying rebuilt it for each clone,
its commands naming the checkout's path). Where the CPU lacks AVX2, FMA or
F16C, or no compiler is found, `extension()` is None and says why; the int4 kernel and the dense
weights run as before.

Where the CPU has VNNI, the AVX2 words build is a second build (`extension(words=True)`): on a
2-core AMD EPYC with AVX-512 (Zen 4) it ran the Q8_0 heads 1.7-1.9x faster than the VNNI build
at 4-16 rows (each 16-bit activation one word there, where VNNI met its two bytes apart), the
K-quants even; since the AVX-512 build meets the 32-weight kinds as words too, 512 bits at a time,
the AVX-512 build is the quicker for them on a Zen 5 EPYC. Which is quicker is the CPU's, so `auto` times both
builds for each shape (quantized._choose) and names the one it keeps (`words`).
"""

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import ninja
import torch
from gguf import GGMLQuantizationType

from inference_app.engine import cpu

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "block_dot.cpp"
KINDS = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                   GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K,
                   GGMLQuantizationType.Q6_K})
REQUIRED_FLAGS = frozenset({"avx2", "fma", "f16c"})
# -fopenmp: at::parallel_for runs on torch's own OpenMP pool only where the extension is built
# with OpenMP (without it, it runs serially); torch's wheel ships the libgomp it binds to.
BASE_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
VNNI_CPU = frozenset({"avx512_vnni", "avx512vl"})
VNNI_FLAGS = ["-mavx512vnni", "-mavx512vl", "-DMILLM_VNNI"]
# The K-quants' 512-bit pass (two sub-blocks a `vpdpbusd`) also needs AVX-512's byte (BW) and dword (DQ) forms.
AVX512_CPU = VNNI_CPU | {"avx512f", "avx512bw", "avx512dq"}
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512dq", "-DMILLM_AVX512"]


def build_flags(flags=None, words=False):
    """The compiler's flags for this CPU (`flags`: its /proc/cpuinfo flags): VNNI's integer dot
    product where it has it, and the 512-bit pass where it has the rest of AVX-512 too; AVX2's
    alone for the `words` build. The build's folder is named by them, so a machine without them
    never loads a build that has them."""
    if words:
        return list(BASE_FLAGS)
    flags = cpu.cpu_flags() if flags is None else flags
    return (BASE_FLAGS + (VNNI_FLAGS if VNNI_CPU <= flags else [])
            + (AVX512_FLAGS if AVX512_CPU <= flags else []))


def build_name(flags):
    """How the start-up line names the build: `(AVX-512 VNNI)`, `(VNNI)` or nothing (AVX2)."""
    return " (AVX-512 VNNI)" if "-DMILLM_AVX512" in flags else " (VNNI)" if "-DMILLM_VNNI" in flags else ""


class Unavailable(Exception):
    """Why the block kernel does not run here (the start-up line says it)."""


@functools.cache
def _build(words=False):
    missing = REQUIRED_FLAGS - cpu.cpu_flags()
    if missing:
        raise Unavailable(f"the CPU lacks {', '.join(sorted(missing))}")
    from torch.utils.cpp_extension import load

    # torch runs `ninja` by name: the wheel's binary, where the engine's PATH lacks the venv.
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    started = time.monotonic()
    try:
        flags = build_flags(words=words)
        name, source = _build_source(flags)
        module = load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                      build_directory=str(source.parent), verbose=False)
    except Exception as error:  # a missing compiler or ninja, a failed build: say so, run without it
        raise Unavailable(f"it could not be built ({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None
    log.info("block kernel%s ready in %.1f s (built once per machine and source)",
             " (AVX2 words)" if words else build_name(flags),
             time.monotonic() - started)
    return module


def _build_source(flags):
    """(module name, the source's copy in its own build folder): both named by a digest of
    what the build depends on, so another checkout of the same source finds the build made."""
    from torch.utils.cpp_extension import get_default_build_root

    code = SOURCE.read_bytes()
    key = "\0".join([*flags, torch.__version__, sys.version]).encode()
    name = f"millm_block_dot_{hashlib.sha256(code + key).hexdigest()[:16]}"
    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / SOURCE.name
    if not copy.exists() or copy.read_bytes() != code:
        staging = folder / f".{SOURCE.name}.{os.getpid()}"
        staging.write_bytes(code)
        os.replace(staging, copy)  # whole or not at all, where two processes build at once
    return name, copy


def extension(words=False):
    """The compiled module (`words`: the AVX2 words build), or None where it cannot run here
    (`why_unavailable` says why)."""
    try:
        return _build(words)
    except Unavailable:
        return None


def has_words_build():
    """Whether the words build is a second build here, beside the CPU's own (a VNNI one)."""
    return extension() is not None and build_flags() != build_flags(words=True) and extension(True) is not None


def why_unavailable():
    try:
        _build(False)
    except Unavailable as reason:
        return str(reason)
    return None


def block_mm(x, blocks, kind, words=False):
    """x [rows, in] times the tensor whose GGUF blocks are `blocks` ([out, bytes a row] uint8):
    float32 [rows, out]; `words`: on the words build."""
    return extension(words).block_mm(x, blocks, int(kind))


if __name__ == "__main__":  # `python -m inference_app.engine.block_kernel`: build it now (make install)
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")
    django.setup()
    reason = why_unavailable()
    print(f"block kernel: {'built' if reason is None else 'not available: ' + reason}"
          f"{' (and its words build)' if reason is None and has_words_build() else ''}")
