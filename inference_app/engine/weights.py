"""The resident weights as tensors: read a safetensors body, check it against the model, write
it in place, save a checkpoint and put one over its base model (SPEC 5, "Weights").

No database here: the Worker decides when (under the admission slot, honouring the lease) and
records the state; these functions only touch tensors and files.
"""

import shutil
import tempfile
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from inference_app.engine import quantized
from inference_app.engine.loader import file_digest
from millm_lib.errors import ApiError

CHECKPOINT_FILE = "model.safetensors"


def invalid_weights(message, details=None):
    return ApiError(400, "invalid_weights_request", message, param="body", details=details)


def read_tensors(data):
    """The named tensors of a safetensors body; a body that is not one is a 400."""
    if not data:
        raise invalid_weights("The body is empty: send a safetensors file of named tensors")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as error:  # safetensors raises its own SafetensorError, and others on garbage
        raise invalid_weights(f"The body is not a safetensors file ({len(data):,} bytes): {error}") from None
    if not tensors:
        raise invalid_weights("The safetensors body names no tensor")
    return tensors


def mismatches(own, tensors):
    """Every name the model's state dict `own` lacks and every shape that differs, each named."""
    found = []
    for name, tensor in tensors.items():
        if name not in own:
            found.append({"name": name, "expected": None, "actual": list(tensor.shape), "reason": "no such tensor"})
        elif tuple(tensor.shape) != tuple(own[name].shape):
            found.append({"name": name, "expected": list(own[name].shape), "actual": list(tensor.shape),
                          "reason": "shape differs"})
        elif not (tensor.is_floating_point() or tensor.dtype == own[name].dtype):
            found.append({"name": name, "expected": str(own[name].dtype), "actual": str(tensor.dtype),
                          "reason": "dtype cannot be cast"})
    return found


def check(own, tensors):
    found = mismatches(own, tensors)
    if found:
        named = "; ".join(
            f"'{m['name']}': no such tensor" if m["expected"] is None
            else f"'{m['name']}': expected {m['expected']}, got {m['actual']}"
            for m in found
        )
        raise invalid_weights(
            f"{len(found)} of {len(tensors)} tensor(s) do not fit the resident model: {named}",
            details={"mismatches": found},
        )


@torch.no_grad()
def write(model, tensors):
    """Overwrite the named tensors in place (cast to the model's dtype and device); all are
    checked before any is written, so a refused body changes nothing."""
    own = model.state_dict()
    check(own, tensors)
    for name, tensor in tensors.items():
        own[name].copy_(tensor.to(device=own[name].device, dtype=own[name].dtype))
    quantized.unpack_changed(model, [own[name] for name in tensors])  # an edited tensor runs dense
    return sorted(tensors)


def checkpoint_folder(data_dir, model_id):
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_id)
    return Path(data_dir) / "checkpoints" / safe


def stage(model, data_dir):
    """Write every tensor to a staging folder under `data_dir`/checkpoints (renamed into place
    once the checkpoint has its id, so no half file is ever at a checkpoint's path); returns
    (the staging folder, a short digest that is the checkpoint's revision)."""
    root = Path(data_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
    try:
        # save_model drops the duplicate names of tied tensors, which save_file refuses.
        safetensors.torch.save_model(model, str(folder / CHECKPOINT_FILE))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder, file_digest(folder / CHECKPOINT_FILE)[:12]


@torch.no_grad()
def apply_checkpoint(model, path):
    """Put a checkpoint's tensors over a freshly loaded base model; every name must match. A
    packed projection whose tensor the checkpoint changed runs dense; the others stay packed."""
    changed = _changed_tensors(model, path)
    missing, unexpected = safetensors.torch.load_model(model, str(path), strict=False, device=str(_device_of(model)))
    if unexpected:
        raise ValueError(f"the checkpoint {path} has tensors its base model lacks: {', '.join(unexpected[:5])}")
    if missing:
        raise ValueError(f"the checkpoint {path} lacks tensors of its base model: {', '.join(missing[:5])}")
    quantized.unpack_changed(model, changed)


def _changed_tensors(model, path):
    """The packed modules' weights that the checkpoint at `path` holds with other values."""
    packed = {module.weight.data_ptr() for module in quantized.packed_modules(model)}
    if not packed:
        return []
    changed = []
    with safetensors.safe_open(str(path), "pt") as handle:
        names = set(handle.keys())
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() in packed and name in names:
                packed.discard(tensor.data_ptr())
                if not torch.equal(handle.get_tensor(name).to(tensor.dtype), tensor):
                    changed.append(tensor)
    return changed


def _device_of(model):
    return next(model.parameters()).device

