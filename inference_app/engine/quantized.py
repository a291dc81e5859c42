"""A GGUF's 4- and 8-bit tensors kept packed, run through torch's int4 CPU kernel (SPEC 7a).

The loader de-quantizes every tensor into the dense model (the conversion cache); this module
then reads the file's own blocks again and packs each Q4_0, Q4_1 and Q8_0 projection for
`torch.ops.aten._weight_int4pack_mm_for_cpu`, which computes with the weight
`(q - 8) * scale + zero` per group of 32 inputs:

- Q4_1 (`w = q·d + m`): scale d, zero m + 8·d.
- Q4_0 (`w = (q - 8)·d`): scale d, zero 0.
- Q8_0 (`w = q·d`, q in -128..127): two 4-bit halves of q + 128 = 16·hi + lo, summed:
  hi with scale 16·d and zero 0, lo with scale d and zero 8·d.

So the packed product uses the file's de-quantized values, to the bfloat16 rounding of the
scales and of the kernel's activations. Before a projection is packed, its blocks (in the row
order the dense weight has: transformers permutes a llama's q and k rows) are checked against
the dense weight the loader made; a tensor that does not match stays dense.

A `PackedLinear` keeps the dense weight too, as its `weight` parameter: the state dict, a probe,
a save and a weight edit see the same tensors as on a dense model. It runs the kernel when a
pass has at most `max_rows` rows and the dense matmul above (a prompt's prefill, a scoring
pack). An edit of the weight drops the packed form (`unpack`): an edited tensor runs dense from
then on.
"""

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import safetensors
import safetensors.numpy
import gguf
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType

log = logging.getLogger(__name__)

GROUP = 32
PACKABLE = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
# The widths at which `auto` times the kernel against the dense matmul, for each shape.
MEASURED_WIDTHS = (1, 2, 4, 8, 16)
# The kernel must take at most this share of the dense matmul's time to be chosen: near a tie
# the choice would flip from load to load with the machine's noise (and dense is the reference).
CLEAR_WIN = 0.9


@dataclass
class Int4Half:
    """One packed operand: q in 0..15 [out, in], scale and zero [out, in / 32], float32."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantized(self):
        groups = self.q.shape[1] // GROUP
        q = self.q.reshape(self.q.shape[0], groups, GROUP).float()
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).reshape(self.q.shape)


def halves(kind, blocks):
    """The int4 halves of a tensor from its GGUF blocks ([out, in / 32 * block bytes] uint8)."""
    rows = blocks.shape[0]
    kind = GGMLQuantizationType(kind)
    if kind == GGMLQuantizationType.Q8_0:
        blocks = blocks.reshape(rows, -1, 34)
        d = _fp16(blocks[..., :2])
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128  # 0..255
        hi, lo = (q >> 4).reshape(rows, -1), (q & 15).reshape(rows, -1)
        return [Int4Half(_int(hi), 16 * d, torch.zeros_like(d)), Int4Half(_int(lo), d, 8 * d)]
    size = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}[kind]
    blocks = blocks.reshape(rows, -1, size)
    d = _fp16(blocks[..., :2])
    nibbles = blocks[..., size - 16:]
    # ggml's order: element j of a block is byte j's low nibble, element j + 16 its high one.
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, -1)
    if kind == GGMLQuantizationType.Q4_0:
        return [Int4Half(_int(q), d, torch.zeros_like(d))]
    m = _fp16(blocks[..., 2:4])
    return [Int4Half(_int(q), d, m + 8 * d)]


def dequantized(parts):
    return sum(part.dequantized() for part in parts)


def _fp16(two_bytes):
    return torch.from_numpy(np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32))


def _int(array):
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))


class PackedLinear(torch.nn.Module):
    """nn.Linear's forward from packed int4 halves at up to `max_rows` rows (None: every
    width), dense above."""

    def __init__(self, linear, parts, max_rows):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties and the state dict are unchanged
        self.bias = linear.bias
        self.max_rows = max_rows
        self.packs = [
            (torch.ops.aten._convert_weight_to_int4pack_for_cpu(part.q, 1),
             torch.stack([part.scale.t(), part.zero.t()], dim=-1).to(torch.bfloat16).contiguous())
            for part in parts
        ]

    @property
    def packed(self):
        return bool(self.packs)

    @property
    def packed_bytes(self):
        return sum(p.numel() * p.element_size() + s.numel() * s.element_size() for p, s in self.packs)

    def unpack(self):
        """The dense weight changed (an edit, a checkpoint): run dense from now on."""
        self.packs = []

    def kernel(self, x):
        """The packed product of `x` [rows, in]: the kernel's own bfloat16 output for one pack,
        the halves summed in float32 for two (Q8_0)."""
        x = x.to(torch.bfloat16).contiguous()
        parts = [torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_and_zeros)
                 for packed, scales_and_zeros in self.packs]
        return parts[0] if len(parts) == 1 else sum(part.float() for part in parts)

    def forward(self, x):
        rows = x.numel() // self.in_features
        if not self.packs or (self.max_rows is not None and rows > self.max_rows):
            return F.linear(x, self.weight, self.bias)
        out = self.kernel(x.reshape(rows, self.in_features))
        if self.bias is not None:
            out = out.float() + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.packed}, max_rows={self.max_rows}"


@dataclass
class Packing:
    """What `pack` did: the fingerprint's and the start-up line's words."""

    packed: int  # projections that run packed at some width
    candidates: int  # projections whose file tensors are packable
    packed_bytes: int
    dense_bytes: int
    widths: dict  # (kind, out, in) -> largest width run packed (0: dense)

    @property
    def label(self):
        return "packed" if self.packed else "dense"

    def describe(self):
        shapes = ", ".join(f"{kind} {rows}x{cols}: {_width_words(width)}"
                           for (kind, rows, cols), width in sorted(self.widths.items()))
        return (f"{self.packed} of {self.candidates} packable projections packed ({shapes}); "
                f"{self.packed_bytes / 2**20:.1f} MiB packed beside {self.dense_bytes / 2**20:.1f} MiB dense")


def _width_words(width):
    if width is None:
        return "packed at every width"
    return "dense" if width == 0 else f"packed up to {width} rows"


def file_tensors(path, cache=None):
    """{GGUF tensor name: (type, blocks)} for the packable tensors of a GGUF file. Reading a
    GGUF's header walks every tokenizer string (seconds): with `cache` (a safetensors path) the
    blocks are read from there, written on the first call."""
    if cache is not None and cache.exists():
        with safetensors.safe_open(str(cache), "np") as handle:
            kinds = handle.metadata()
            return {name: (GGMLQuantizationType[kinds[name]], handle.get_tensor(name)) for name in handle.keys()}
    reader = gguf.GGUFReader(str(path))  # looked up here: gguf_reading.read_once() may share one
    tensors = {t.name: (t.tensor_type, np.asarray(t.data)) for t in reader.tensors if t.tensor_type in PACKABLE}
    if cache is not None:
        staging = cache.with_name(f".{cache.name}.{os.getpid()}")
        safetensors.numpy.save_file({name: blocks for name, (_, blocks) in tensors.items()}, str(staging),
                                    metadata={name: GGMLQuantizationType(kind).name for name, (kind, _) in tensors.items()})
        os.replace(staging, cache)  # whole or not at all
    return tensors


def gguf_names(model, tensors):
    """{transformers module name: GGUF tensor name in `tensors`} for the model's linear weights
    (gguf's own name map, as transformers' GGUF loader uses it)."""
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == model.config.model_type), None)
    if arch is None:
        return {}
    name_map = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            gguf_name = name_map.get_name(name)
            if gguf_name is not None:
                names[name] = f"{gguf_name}.weight"
    # A tied head has no tensor of its own in the file: it is the token embedding.
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is embedding.weight:
        module_names = {module: name for name, module in model.named_modules()}
        head_name = module_names.get(head)
        embedding_name = name_map.get_name(module_names.get(embedding, ""))
        if names.get(head_name) not in tensors and f"{embedding_name}.weight" in tensors:
            names[head_name] = f"{embedding_name}.weight"
    return {name: gguf for name, gguf in names.items() if gguf in tensors}


def row_orders(model, gguf_name, rows):
    """Candidate row orders of a file tensor in the dense weight: as stored, and transformers'
    own llama q/k permutation (applied to the row indices)."""
    orders = [torch.arange(rows)]
    config = model.config
    if ".attn_q." in gguf_name or ".attn_k." in gguf_name:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        n = heads if ".attn_q." in gguf_name else kv_heads
        dim = rows // n // 2
        orders.append(torch.arange(rows).reshape(n, dim, 2).swapaxes(2, 1).reshape(rows))
    return orders


def matching_parts(weight, parts, orders):
    """The parts in the dense weight's row order, or None when no order reproduces the weight
    to the rounding of its dtype."""
    reference = dequantized(parts)
    dense = weight.detach().float()
    tolerance = torch.finfo(weight.dtype).eps * (float(reference.abs().max()) + 1e-6)
    for order in orders:
        if float((reference[order] - dense).abs().max()) <= tolerance:
            return [Int4Half(p.q[order].contiguous(), p.scale[order].contiguous(), p.zero[order].contiguous())
                    for p in parts]
    return None


def pack(model, path, mode, cache=None):
    """Swap the model's linear layers whose file tensors are packable for PackedLinear.

    `mode`: "quantized" runs every one packed at every width; "auto" times each shape at
    MEASURED_WIDTHS and runs it packed up to the largest width where the kernel took at most
    CLEAR_WIN of the dense time at that width and every smaller one (dense everywhere when it
    did not at one row). A shape that stays dense has its packs built once, to time them."""
    tensors = file_tensors(path, cache)
    names = gguf_names(model, tensors)
    modules = dict(model.named_modules())
    candidates, widths = [], {}
    for name, gguf_name in names.items():
        linear = modules.get(name)
        if not isinstance(linear, torch.nn.Linear):
            continue
        kind, blocks = tensors[gguf_name]
        parts = halves(kind, np.asarray(blocks))
        parts = matching_parts(linear.weight, parts, row_orders(model, gguf_name, linear.out_features))
        if parts is None:
            log.warning("%s: the file's %s blocks do not reproduce the loaded weight; it runs dense", name, gguf_name)
            continue
        candidates.append((name, GGMLQuantizationType(kind).name, linear, parts))
    packed = 0
    for name, kind, linear, parts in candidates:
        shape = (kind, linear.out_features, linear.in_features)
        if widths.get(shape) == 0:
            continue
        module = PackedLinear(linear, parts, None)
        if shape not in widths:
            widths[shape] = None if mode == "quantized" else _packed_width(module)
        if widths[shape] == 0:
            continue
        module.max_rows = widths[shape]
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
        packed += 1
    packing = Packing(
        packed=packed, candidates=len(candidates), widths=widths,
        packed_bytes=sum(m.packed_bytes for m in model.modules() if isinstance(m, PackedLinear)),
        dense_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
    )
    log.info("weights: %s", packing.describe())
    return packing


@torch.inference_mode()
def _packed_width(module, repeats=15):
    """The largest measured width up to which the kernel clearly beat the dense matmul at
    every measured width; 0 when it did not at one row."""
    width = 0
    for rows in MEASURED_WIDTHS:
        x = torch.randn(rows, module.in_features, dtype=module.weight.dtype)
        kernel = _best_time(lambda: module.kernel(x).to(x.dtype), repeats)
        dense = _best_time(lambda: F.linear(x, module.weight, module.bias), repeats)
        if kernel > dense * CLEAR_WIN:
            break
        width = rows
    return width


def _best_time(function, repeats):
    """The fastest of `repeats` calls after a warm-up: the engine's other threads (heartbeat,
    channels) run beside the load, and a median of a 100 us call moved with them (the down
    projection at one row came out packed in one load and dense in the next)."""
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


def packed_modules(model):
    return [module for module in model.modules() if isinstance(module, PackedLinear) and module.packed]


def width_bounds(model):
    """The widths above which some packed projection switches to its dense matmul: a compiled
    step (compiled.py) sees each as a shape bucket's edge."""
    return sorted({module.max_rows for module in packed_modules(model) if module.max_rows is not None})


def unpack_changed(model, tensors):
    """After an edit: every packed module whose weight is one of `tensors` runs dense."""
    edited = {tensor.data_ptr() for tensor in tensors}
    dropped = 0
    for module in packed_modules(model):
        if module.weight.data_ptr() in edited:
            module.unpack()
            dropped += 1
    return dropped
