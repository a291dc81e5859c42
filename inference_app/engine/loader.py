"""Load a model from a Hugging Face-format folder or a GGUF file.

GGUF goes through transformers' own GGUF support, which de-quantizes every tensor; the result
is written once to a conversion cache under MILLM_DATA_DIR, so a second start loads plain
safetensors instead of de-quantizing again.
"""

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from django.conf import settings
from transformers import AutoModelForCausalLM, AutoTokenizer

from inference_app.catalogue import ModelSource
from inference_app import chat_templates
from inference_app.engine import attention, gguf_reading, quantized, timed_widths
from inference_app.engine.cpu import cpu_flags, flags_of  # noqa: F401 (flags_of: the tests' recorded texts)
from inference_app.models import ModelEntry

log = logging.getLogger(__name__)

CACHE_VERSION = 1


@dataclass
class LoadedModel:
    source: ModelSource
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    revision: str | None
    chat_template: chat_templates.ChatTemplate  # what chat renders with (chat_templates.resolve)
    weights: str = "dense"  # "packed" when a GGUF's quantized tensors run packed (quantized.py)


def pick_device(setting=None):
    setting = setting or settings.MILLM_DEVICE
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


# CPU flags of native bfloat16 arithmetic (SPEC 7a): AVX-512 BF16 and AMX's tiles.
NATIVE_BFLOAT16 = frozenset({"avx512_bf16", "amx_bf16"})


def pick_dtype(device, setting=None, flags=None):
    """MILLM_DTYPE: `auto` is bfloat16 on CUDA and on a CPU with native bfloat16 (`flags`: the
    CPU's, from /proc/cpuinfo), float32 elsewhere; any other setting is that dtype."""
    setting = setting or settings.MILLM_DTYPE
    if setting != "auto":
        return getattr(torch, setting)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and NATIVE_BFLOAT16 & (cpu_flags() if flags is None else set(flags)):
        return torch.bfloat16
    return torch.float32


def pick_weights(device, setting=None, dtype_setting=None):
    """MILLM_WEIGHTS: what a GGUF's quantized projections run from. `dense` (the de-quantized
    weights), `quantized` (torch's int4 kernel at every width), `blocks` (the block kernel at
    every width, block_kernel.py), `auto` (packed where a kernel measures faster at load, per
    shape and width) except under an explicit MILLM_DTYPE=float32, which stays the exact
    reference. Both kernels are CPU ones: dense elsewhere."""
    setting = setting or settings.MILLM_WEIGHTS
    dtype_setting = dtype_setting or settings.MILLM_DTYPE
    if setting == "dense" or device.type != "cpu":
        return "dense"
    if setting == "auto" and dtype_setting == "float32":
        return "dense"
    return setting


def load_model(source, device=None, dtype=None, weights=None):
    """1. Find the folder to load (the source, or the GGUF's conversion cache, built if missing).
    2. Load tokenizer and weights from it, cast to the dtype, move to the device, eval mode;
       16-bit decode steps on a CPU attend in float32 (attention.py).
    3. A GGUF's quantized projections run packed where `weights` (pick_weights) says so."""
    device = device or pick_device()
    dtype = dtype or pick_dtype(device)
    weights = weights or pick_weights(device)
    started = time.monotonic()
    with gguf_reading.read_once():
        if source.format == ModelEntry.Format.GGUF:
            folder, revision = _gguf_cache(source)
        else:
            folder, revision = source.path, _folder_revision(source.path)
        log.info("loading %s from %s (%s, %s)", source.model_id, folder, device, dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        template = chat_templates.resolve(tokenizer, source.chat_template)
        chat_templates.apply(tokenizer, template)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        model.to(device)
        model.eval()
        attends, why = attention.use_for(model, device, dtype, settings.ENGINE_DECODE_ATTENTION)
        form = "dense"
        if source.format == ModelEntry.Format.GGUF and weights != "dense":
            packing = quantized.pack(model, source.path, weights, cache=Path(folder) / "millm-blocks.safetensors",
                                     timings=timed_widths.location(folder, settings.MILLM_TIMINGS_DIR))
            form = packing.label
    log.info("loaded %s in %.1f s (%s, %s weights, %s attention%s, chat template: %s)", source.model_id,
             time.monotonic() - started, attention.dtype_name(dtype), form, attends,
             f" ({why})" if why else "", template.origin)
    return LoadedModel(source, model, tokenizer, device, dtype, revision, template, form)


def _folder_revision(folder):
    marker = Path(folder) / ".millm-revision"
    return marker.read_text().strip() if marker.exists() else None


def _gguf_cache(source):
    stat = source.path.stat()
    key = hashlib.sha256(f"{CACHE_VERSION}|{source.path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:20]
    root = settings.MILLM_DATA_DIR / "model-cache"
    folder = root / key
    marker = folder / "millm-source.json"
    if marker.exists():
        return folder, json.loads(marker.read_text())["revision"]
    log.info("converting %s (first start; later starts read the cache %s)", source.path, folder)
    revision = file_digest(source.path)[:12]
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
        model = AutoModelForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name)
        # The tensors are already de-quantized; the GGUF "quantizer" left on the model is only a
        # marker, and transformers refuses to save while it is there.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "millm-source.json").write_text(
            json.dumps({"source": str(source.path), "revision": revision, "quantization": source.quantization})
        )
        # Renamed into place whole, so a crash mid-conversion never leaves a half cache.
        os.rename(staging, folder)
    except FileExistsError:
        shutil.rmtree(staging, ignore_errors=True)  # another engine converted it first
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        if not marker.exists():
            raise error
    return folder, json.loads(marker.read_text())["revision"]


def file_digest(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
