"""A GGUF's 4-, 5- and 8-bit tensors kept packed, run through torch's int4 CPU kernel (SPEC 7a).

The loader de-quantizes every tensor into the dense model (the conversion cache); this module
then reads the file's own blocks again and packs each projection of a PACKABLE type for
`torch.ops.aten._weight_int4pack_mm_for_cpu`, which computes with the weight
`(q - 8) * scale + zero` per group of 32 inputs:

- Q4_1 (`w = q·d + m`): scale d, zero m + 8·d.
- Q4_0 (`w = (q - 8)·d`): scale d, zero 0.
- Q4_K (`w = d·sc_j·q - dmin·m_j` in sub-block j of 32 of a 256-weight super-block, sc_j and
  m_j 6-bit): scale d·sc_j, zero 8·d·sc_j - dmin·m_j.
- Q8_0 (`w = q·d`, q in -128..127): two 4-bit halves of q + 128 = 16·hi + lo, summed:
  hi with scale 16·d and zero 0, lo with scale d and zero 8·d.
- Q5_0 (`w = (q - 16)·d`, q in 0..31) and Q5_K (`w = d·sc_j·q - dmin·m_j`): two halves of
  q = 16·hi + lo, hi (0 or 1) with scale 16·D and zero 128·D (its value 16·D·hi), lo with
  scale D and zero -8·d (Q5_0) or 8·D - dmin·m_j (Q5_K), where D is d or d·sc_j.

Q6_K has no int4 form: its sub-blocks have 16 weights, and the kernel takes groups of 32, 64,
128 or 256 only. It runs packed on the block kernel (block_kernel.py, which takes every kind
above too), and dense where that kernel does not run here or the mode is `quantized`. The
start-up line names the types that stay dense for want of a kernel.

So the packed product uses the file's de-quantized values, to the bfloat16 rounding of the
scales and of the kernel's activations (a two-half kind calls the kernel twice). Before a projection is packed, its blocks (in the row
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
from pathlib import Path
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import safetensors
import safetensors.numpy
import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

from inference_app.engine import block_kernel, gguf_reading, timed_widths

log = logging.getLogger(__name__)

GROUP = 32
# The types whose blocks are read: those with an int4 form (HALVES, below) and Q6_K, which only
# the block kernel takes.
PACKABLE = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K,
            GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
            GGMLQuantizationType.Q8_0}
# A block cache's metadata key for the PACKABLE set it was written for: a cache from before a
# type became packable lacks that type's blocks, and is read again from the file.
CACHE_KINDS = "millm-packable"
# The widths at which `auto` times the kernel against the dense matmul, for each shape.
MEASURED_WIDTHS = (1, 2, 4, 8, 16)
# The kernel must take at most this share of the dense matmul's time to be chosen: near a tie
# the choice would flip from load to load with the machine's noise (and dense is the reference).
CLEAR_WIN = 0.9


@dataclass
class Int4Half:
    """One packed operand: q in 0..15 [out, in] uint8 (the kernel's int32 only while packing:
    a quarter of the bytes while a load holds every projection's parts), scale and zero
    [out, in / 32] float32."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantized(self):
        """(q - 8)·scale + zero in float32, one rounding per operation. In place: Gemma's head
        is 168M weights, and a fresh tensor per operation cost seconds of page faults."""
        groups = self.q.shape[1] // GROUP
        weight = self.q.reshape(self.q.shape[0], groups, GROUP).float()
        return weight.sub_(8).mul_(self.scale[..., None]).add_(self.zero[..., None]).reshape(self.q.shape)


def halves(kind, blocks):
    """The int4 halves of a tensor from its GGUF blocks ([out, in / block size * block bytes]
    uint8): one for a 4-bit kind, two for a 5- or 8-bit one."""
    kind = GGMLQuantizationType(kind)
    _, block_bytes = GGML_QUANT_SIZES[kind]
    return HALVES[kind](blocks.reshape(blocks.shape[0], -1, block_bytes))


def _q4_0(blocks):
    d = _fp16(blocks[..., :2])
    return [Int4Half(_q(_nibbles(blocks[..., 2:])), d, torch.zeros_like(d))]


def _q4_1(blocks):
    d, m = _fp16(blocks[..., :2]), _fp16(blocks[..., 2:4])
    return [Int4Half(_q(_nibbles(blocks[..., 4:])), d, m + 8 * d)]


def _q8_0(blocks):
    d = _fp16(blocks[..., :2])
    q = blocks[..., 2:] ^ np.uint8(128)  # the int8 q + 128 (0..255): its sign bit flipped
    rows = blocks.shape[0]
    hi, lo = (q >> 4).reshape(rows, -1), (q & 15).reshape(rows, -1)
    return [Int4Half(_q(hi), 16 * d, torch.zeros_like(d)), Int4Half(_q(lo), d, 8 * d)]


def _q5_0(blocks):
    """hi's zero 128·d makes its value 16·d·hi, lo's zero -8·d makes its (lo - 16)·d: both
    zeros are the scale times a power of two, so the kernel's bfloat16 rounding of them is the
    rounding of d itself, as for Q4_0 and Q8_0."""
    d = _fp16(blocks[..., :2])
    # ggml's order: bit j of the little-endian 32-bit qh is element j's fifth bit.
    hi = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little").reshape(blocks.shape[0], -1)
    return _five_bits(hi, _nibbles(blocks[..., 6:]), d, -8 * d)


def _q4_k(blocks):
    """Exactly gguf's value wherever the zero 8·d·sc_j - dmin·m_j is itself a float32 (d and
    dmin of like size: all 737280 of the Gemma file's are): the kernel's form adds it to the
    exact (q - 8)·d·sc_j, gguf subtracts dmin·m_j from the exact q·d·sc_j, one rounding each."""
    scale, minimum = _k_scales(blocks)
    return [Int4Half(_q(_k_nibbles(blocks[..., 16:])), scale, 8 * scale - minimum)]


def _q5_k(blocks):
    scale, minimum = _k_scales(blocks)
    # Bit j of qh's byte i is the fifth bit of element i of sub-block j.
    qh = blocks[..., 16:48]
    hi = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    return _five_bits(hi.reshape(blocks.shape[0], -1), _k_nibbles(blocks[..., 48:]), scale, 8 * scale - minimum)


def _five_bits(hi, lo, scale, lo_zero):
    """q = 16·hi + lo as two halves: hi (0 or 1) worth 16·scale·hi, lo with its own zero."""
    return [Int4Half(_q(hi), 16 * scale, 128 * scale), Int4Half(_q(lo), scale, lo_zero)]


def _nibbles(nibbles):
    """[out, blocks, 16] bytes -> [out, in]: ggml's order in a 32-weight block, element j is
    byte j's low nibble, element j + 16 its high one."""
    return np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(nibbles.shape[0], -1)


def _k_nibbles(nibbles):
    """[out, super-blocks, 128] bytes -> [out, in]: a K-quant's 32 bytes of each pair of
    sub-blocks hold sub-block 2c in their low nibbles and sub-block 2c + 1 in their high ones."""
    pairs = nibbles.reshape(*nibbles.shape[:2], 4, 1, 32)
    return np.concatenate([pairs & 15, pairs >> 4], axis=-2).reshape(nibbles.shape[0], -1)


def _k_scales(blocks):
    """The per-32 scale d·sc_j and minimum dmin·m_j [out, in / 32] of Q4_K and Q5_K super-blocks
    (d, dmin fp16, then 12 bytes of 6-bit sc and m, unpacked by gguf's own code). Products of
    an fp16 and a 6-bit integer: exact in float32, as gguf's de-quantizer has them."""
    rows, count = blocks.shape[:2]
    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    d, dmin = _fp16(blocks[..., :2]), _fp16(blocks[..., 2:4])
    scale = d[..., None] * torch.from_numpy(sc.astype(np.float32)).reshape(rows, count, 8)
    minimum = dmin[..., None] * torch.from_numpy(m.astype(np.float32)).reshape(rows, count, 8)
    return scale.reshape(rows, -1), minimum.reshape(rows, -1)


HALVES = {GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q4_1: _q4_1, GGMLQuantizationType.Q4_K: _q4_k,
          GGMLQuantizationType.Q5_0: _q5_0, GGMLQuantizationType.Q5_K: _q5_k, GGMLQuantizationType.Q8_0: _q8_0}


def dequantized(parts):
    """The parts' sum: the halves' values added in float32, in their order."""
    total = parts[0].dequantized()
    for part in parts[1:]:
        total += part.dequantized()
    return total


def _fp16(two_bytes):
    return torch.from_numpy(np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32))


def _q(array):
    """uint8: the bytes a 4-bit value needs until the kernel's packing."""
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.uint8))


def _int4pack(q, rows=8192):
    """The kernel's packed form of q, a block of rows at a time (rows pack independently; the
    int32 the packing wants is 670 MB for Gemma's head)."""
    return torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[start:start + rows].int(), 1)
                      for start in range(0, q.shape[0], rows)])


class PackedLinear(torch.nn.Module):
    """nn.Linear's forward from packed weights at up to `max_rows` rows (None: every width),
    dense above: torch's int4 kernel on int4 halves (`parts`), or the block kernel on the file's
    own blocks (`blocks`: (GGML type, [out, bytes a row] uint8), block_kernel.py; `words`: its
    AVX2 words build)."""

    def __init__(self, linear, parts, max_rows, blocks=None, words=False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties and the state dict are unchanged
        self.bias = linear.bias
        self.max_rows = max_rows
        self.packs = [
            (_int4pack(part.q),
             torch.stack([part.scale.t(), part.zero.t()], dim=-1).to(torch.bfloat16).contiguous())
            for part in parts or ()
        ]
        self.blocks = blocks
        self.words = words

    @property
    def packed(self):
        return bool(self.packs) or self.blocks is not None

    @property
    def form(self):
        """Which kernel runs it: `blocks`, `words` (the block kernel's words build) or `int4`."""
        return "int4" if self.blocks is None else "words" if self.words else "blocks"

    @property
    def packed_bytes(self):
        blocks = self.blocks[1].numel() if self.blocks is not None else 0
        return blocks + sum(p.numel() * p.element_size() + s.numel() * s.element_size() for p, s in self.packs)

    def unpack(self):
        """The dense weight changed (an edit, a checkpoint): run dense from now on."""
        self.packs = []
        self.blocks = None

    def kernel(self, x):
        """The packed product of `x` [..., in] (`packed_product`)."""
        return packed_product(x, self.blocks, self.packs, self.words)

    def forward(self, x):
        rows = x.numel() // self.in_features
        if not self.packed or (self.max_rows is not None and rows > self.max_rows):
            return F.linear(x, self.weight, self.bias)
        out = self.kernel(x)
        if self.bias is not None:
            out = out.float() + self.bias.float()
        return as_dtype(out, x.dtype)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.packed}, max_rows={self.max_rows}"


def packed_product(x, blocks, packs, words=False):
    """`x` [..., in] times packed weights, [..., out]: with `blocks` ((GGML type, [out, bytes a
    row] uint8)), the block kernel's float32 (it takes and gives the leading dimensions itself;
    `words`: its words build); else the int4 kernel's own bfloat16 output for one of `packs`, the
    halves summed in float32 for two (Q8_0)."""
    if blocks is not None:
        return block_kernel.block_mm(x, blocks[1], blocks[0], words)
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    parts = [torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scales_and_zeros)
             for packed, scales_and_zeros in packs]
    product = parts[0] if len(parts) == 1 else sum(part.float() for part in parts)
    return product.view(*x.shape[:-1], product.shape[-1])


def as_dtype(tensor, dtype):
    """`tensor` in `dtype`, itself where it is already (a cast that changes nothing still cost a
    call's worth of time at one row)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


@dataclass
class Packing:
    """What `pack` did: the fingerprint's and the start-up line's words."""

    packed: int  # projections that run packed at some width
    candidates: int  # projections whose file tensors have a kernel here (blocks read, the row order found)
    packed_bytes: int
    dense_bytes: int
    widths: dict  # (kind, out, in) -> largest width run packed (0: dense)
    no_kernel: dict = None  # type name -> projections of that type, which run dense
    forms: dict = None  # (kind, out, in) -> the kernel that runs it packed: "blocks", "words" or "int4"
    blocks_unavailable: str = None  # why the block kernel does not run here, where it was wanted
    timed_before: int = 0  # shapes whose width `auto` read from an earlier load's timing (timed_widths.py)
    timings: Path = None  # the file those timings are kept in

    @property
    def label(self):
        return "packed" if self.packed else "dense"

    def describe(self):
        forms = self.forms or {}
        shapes = ", ".join(f"{kind} {rows}x{cols}: {_width_words(width, forms.get((kind, rows, cols)))}"
                           for (kind, rows, cols), width in sorted(self.widths.items()))
        words = (f"{self.packed} of {self.candidates} packable projections packed ({shapes}); "
                 f"{self.packed_bytes / 2**20:.1f} MiB packed beside {self.dense_bytes / 2**20:.1f} MiB dense")
        if self.timed_before:
            words += (f"; {self.timed_before} shapes' widths as timed by an earlier load on this machine"
                      f" ({self.timings}; delete it to time again)")
        if self.blocks_unavailable:
            words += f"; no block kernel: {self.blocks_unavailable}"
        if self.no_kernel:
            kinds = ", ".join(f"{kind} x{count}" for kind, count in sorted(self.no_kernel.items()))
            words += f"; dense for want of a kernel: {kinds}"
        return words


def _width_words(width, form=None):
    kernel = " (blocks kernel, words build)" if form == "words" else f" ({form} kernel)" if form else ""
    if width is None:
        return f"packed at every width{kernel}"
    return "dense" if width == 0 else f"packed up to {width} rows{kernel}"


def file_tensors(path, cache=None):
    """{GGUF tensor name: (type, blocks)} for every tensor of a GGUF file, blocks None where the
    type is not packable (such a projection is named as dense for want of a kernel). Reading a
    GGUF's header walks every tokenizer string (seconds): with `cache` (a safetensors path) the
    blocks are read from there, written on the first call and again when PACKABLE has grown."""
    tensors = _cached_tensors(cache) if cache is not None else None
    if tensors is not None:
        return tensors
    reader = gguf_reading.reader(path)  # gguf_reading.read_once() may share one
    tensors = {t.name: (GGMLQuantizationType(t.tensor_type), np.asarray(t.data) if t.tensor_type in PACKABLE else None)
               for t in reader.tensors}
    if cache is not None:
        write_blocks(cache, tensors)
    return tensors


def write_blocks(cache, tensors):
    """Write {name: (type, blocks or None)} as a block cache: the packable blocks as tensors,
    every tensor's type and the PACKABLE set in the metadata; whole or not at all."""
    staging = cache.with_name(f".{cache.name}.{os.getpid()}")
    metadata = {name: GGMLQuantizationType(kind).name for name, (kind, _) in tensors.items()}
    metadata[CACHE_KINDS] = _kinds_key()
    safetensors.numpy.save_file({name: blocks for name, (_, blocks) in tensors.items() if blocks is not None},
                                str(staging), metadata=metadata)
    os.replace(staging, cache)


def _cached_tensors(cache):
    """The block cache's tensors, or None where there is none or it was written for another
    PACKABLE set (a cache from before Q4_K and Q5_0 were packable holds only Q4_0, Q4_1 and
    Q8_0 blocks: read as it is, Gemma's Q5_0 projections would have stayed dense unnamed)."""
    if not cache.exists():
        return None
    with safetensors.safe_open(str(cache), "np") as handle:
        kinds = dict(handle.metadata() or {})
        if kinds.pop(CACHE_KINDS, None) != _kinds_key():
            return None
        stored = set(handle.keys())
        return {name: (GGMLQuantizationType[kind], handle.get_tensor(name) if name in stored else None)
                for name, kind in kinds.items()}


def _kinds_key():
    return ",".join(sorted(kind.name for kind in PACKABLE))


def gguf_names(model, tensors):
    """{transformers module name: GGUF tensor name in `tensors`} for the model's linear weights,
    by the map transformers' own GGUF loader converted the file with. That map knows where a
    transformers model type and gguf's architecture names differ (Gemma 3's `gemma3_text` is
    gguf's `gemma3`): a lookup of the model type in gguf's MODEL_ARCH_NAMES found no
    architecture for Gemma 3, and nothing was packed ("0 of 0")."""
    try:
        with gguf_reading.read_once():  # it builds gguf's name map once per module otherwise (2 s)
            to_model = get_gguf_hf_weights_map(model, TensorProcessor())
    except NotImplementedError:  # an architecture gguf-py does not name
        return {}
    from_model = {parameter: gguf_name for gguf_name, parameter in to_model.items()}
    names = {}
    module_names = {}
    for name, module in model.named_modules():
        module_names.setdefault(module, name)
        if isinstance(module, torch.nn.Linear) and f"{name}.weight" in from_model:
            names[name] = from_model[f"{name}.weight"]
    # A tied head has no tensor of its own in the file: it is the token embedding.
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embedding is not None and head.weight is embedding.weight:
        head_name = module_names.get(head)
        embedding_name = from_model.get(f"{module_names.get(embedding)}.weight")
        if names.get(head_name) not in tensors and embedding_name in tensors:
            names[head_name] = embedding_name
    return {name: gguf_name for name, gguf_name in names.items() if gguf_name in tensors}


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


def file_values(kind, blocks, parts=None):
    """The tensor's values [out, in] float32: the int4 halves' sum where it has them (the values
    the int4 kernel multiplies by), else gguf's own de-quantizer (Q6_K)."""
    if parts:
        return dequantized(parts)
    return torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(blocks.shape[0], -1))


def matching_order(weight, reference, orders):
    """The first of `orders` in which the rows of `reference` (the file's values) reproduce the
    dense weight to the rounding of its dtype, or None when none does."""
    low, high = torch.aminmax(reference)
    tolerance = torch.finfo(weight.dtype).eps * (max(-float(low), float(high)) + 1e-6)
    return next((order for order in orders if _largest_difference(reference, weight.detach(), order) <= tolerance), None)


def in_order(parts, blocks, order):
    """The parts (None: none) and the file's blocks ([out, bytes a row]) with their rows in `order`."""
    if torch.equal(order, torch.arange(len(order))):
        return parts, blocks
    return ([Int4Half(p.q[order].contiguous(), p.scale[order].contiguous(), p.zero[order].contiguous())
             for p in parts or ()] or None, blocks[order].contiguous())


def _largest_difference(reference, dense, order, rows=8192):
    """max |reference[order] - dense|, a block of rows at a time: the head's whole difference
    would be three more 670 MB float32 tensors."""
    largest = 0.0
    for start in range(0, len(order), rows):
        block = reference[order[start:start + rows]] - dense[start:start + rows].float()
        largest = max(largest, float(block.abs_().max()))
    return largest


def pack(model, path, mode, cache=None, timings=None):
    """Swap the model's linear layers whose file tensors are packable for PackedLinear.

    `mode`: "quantized" runs every one packed at every width; "auto" times each shape at
    MEASURED_WIDTHS and runs it packed up to the largest width where the kernel took at most
    CLEAR_WIN of the dense time at that width and every smaller one (dense everywhere when it
    did not at one row). A shape that stays dense has its packs built once, to time them. Where
    an earlier load on this machine timed a shape (timed_widths.py: the file `timings`, else
    beside `cache`), its choice is read, not timed again."""
    tensors = file_tensors(path, cache)
    names = gguf_names(model, tensors)
    modules = dict(model.named_modules())
    widths, forms, no_kernel = {}, {}, {}
    candidates = packed = 0
    flush = None
    blocks_wanted = False
    timed = None
    if mode == "auto":  # the widths an earlier load timed on this machine, where the cache is
        key = timed_widths.machine_key(next(model.parameters()).dtype, [CLEAR_WIN, MEASURED_WIDTHS])
        if timings is None and cache is not None:
            timings = timed_widths.location(cache.parent)
        timed = timed_widths.TimedWidths(timings, key)
    # One projection at a time: its halves and blocks are made, checked, packed, and the form not
    # chosen dropped before the next is read (Gemma's Q8_0 head alone is about 420 MB of int4 halves
    # and their scales while it is packed).
    for name, gguf_name in names.items():
        linear = modules.get(name)
        if not isinstance(linear, torch.nn.Linear):
            continue
        kind, blocks = tensors[gguf_name]
        kind = GGMLQuantizationType(kind)
        block_kind = mode in ("auto", "blocks") and kind in block_kernel.KINDS
        blocks_wanted |= block_kind
        with_blocks = block_kind and blocks is not None and block_kernel.extension() is not None
        if blocks is None or not (kind in HALVES or with_blocks):
            no_kernel[kind.name] = no_kernel.get(kind.name, 0) + 1
            continue
        blocks = np.asarray(blocks)
        parts = halves(kind, blocks) if kind in HALVES else None
        order = matching_order(linear.weight, file_values(kind, blocks, parts),
                               row_orders(model, gguf_name, linear.out_features))
        if order is None:
            log.warning("%s: the file's %s blocks do not reproduce the loaded weight; it runs dense", name, gguf_name)
            continue
        candidates += 1
        shape = (kind.name, linear.out_features, linear.in_features)
        if widths.get(shape) == 0:
            continue
        # A copy: a file's blocks are a read-only map, which torch refuses to share (a warning).
        rows = torch.from_numpy(np.array(blocks, copy=True).reshape(linear.out_features, -1))
        parts, rows = in_order(parts, rows, order)
        module = None
        if shape not in widths:
            recorded = timed.get(shape) if timed is not None else None
            if recorded is not None and (recorded[0] == "blocks" and with_blocks or recorded[0] == "int4" and parts
                                         or recorded[0] == "words" and with_blocks and block_kernel.has_words_build()):
                forms[shape], widths[shape] = recorded
                timed.reuse(shape)
            else:
                if mode == "auto" and flush is None:
                    flush = _CacheFlush()
                forms[shape], widths[shape], module = _choose(mode, linear, parts, (kind, rows), flush, with_blocks)
                if timed is not None:
                    timed.record(shape, forms[shape], widths[shape])
            if widths[shape] == 0:
                forms.pop(shape)
                continue
        if module is None:
            module = (PackedLinear(linear, parts, widths[shape]) if forms[shape] == "int4"
                      else PackedLinear(linear, None, widths[shape], blocks=(kind, rows), words=forms[shape] == "words"))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
        packed += 1
    packing = Packing(
        packed=packed, candidates=candidates, widths=widths, no_kernel=no_kernel, forms=forms,
        blocks_unavailable=block_kernel.why_unavailable() if blocks_wanted else None,
        timed_before=len(timed.reused) if timed is not None else 0, timings=timings,
        packed_bytes=sum(m.packed_bytes for m in model.modules() if isinstance(m, PackedLinear)),
        dense_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
    )
    if timed is not None:
        timed.write()
    log.info("weights: %s", packing.describe())
    return packing


def _choose(mode, linear, parts, blocks, flush, with_blocks):
    """(kernel, width, module) for a shape: `quantized` the int4 kernel at every width; `blocks`
    the block kernel at every width where its type has one (else the int4 kernel); `auto` each
    kernel timed against the dense matmul (`_packed_width`), the one packed to the larger width
    kept (at a tie, the faster at one row), width 0 where neither clearly won at one row. Where
    the block kernel has a words build beside the CPU's own (block_kernel.has_words_build), the
    two builds are timed and the one packed to the larger width kept first (at a tie, the one
    whose calls at the measured widths took less time together: they differ most at 8-16 rows).
    The module is the shape's first projection packed in that form (None where none is built)."""
    if mode == "quantized" or (mode == "blocks" and not with_blocks):
        return "int4", None, None
    if mode == "blocks":
        return "blocks", None, None
    timed = {}
    if parts:  # every kind but Q6_K
        int4 = PackedLinear(linear, parts, None)
        timed["int4"] = (_packed_width(int4, flush), int4)
    if with_blocks:
        timed["blocks"] = _block_builds_timed(linear, blocks, flush)
    if len(timed) == 2 and timed["blocks"][0] == timed["int4"][0] > 0:
        x = torch.randn(1, linear.in_features, dtype=linear.weight.dtype)
        speed = {form: _best_time(lambda m=module: m.kernel(x), 7, flush) for form, (_, module) in timed.items()}
        form = min(speed, key=speed.get)
    else:
        form = max(timed, key=lambda name: timed[name][0])
    width, module = timed[form]
    module.max_rows = width
    return module.form, width, module


def _block_builds_timed(linear, blocks, flush):
    """(width, module) of the block kernel's build packed to the larger width (`_choose`)."""
    builds = []
    for words in (False, True) if block_kernel.has_words_build() else (False,):
        module = PackedLinear(linear, None, None, blocks=blocks, words=words)
        width, times = _packed_width(module, flush, with_times=True)
        spent = sum(times[:MEASURED_WIDTHS.index(width) + 1]) if width else 0.0
        builds.append((width, spent, module))
    width, _, module = max(builds, key=lambda build: (build[0], -build[1]))  # the widest; at a tie, the quicker
    return width, module


@torch.inference_mode()
def _packed_width(module, flush, repeats=7, with_times=False):
    """The largest measured width up to which the kernel clearly beat the dense matmul at
    every measured width; 0 when it did not at one row. Each call is timed with the caches
    emptied first, as a decode step meets every weight: the step reads the whole model, so a
    projection's weight is never still cached from its last use. Timed hot, a 2.6 MB dense
    weight ran from the cache and beat the kernel that reads a third of its bytes, so Gemma's
    feed-forward projections stayed dense (a one-row step 47 ms, 28.5 ms with them packed).
    `with_times`: (width, the kernel's time at each width measured)."""
    width, times = 0, []
    if module.weight.numel() * module.weight.element_size() >= flush.bytes:
        flush = None  # the weight alone overflows the caches: every call reads it from memory
    for rows in MEASURED_WIDTHS:
        x = torch.randn(rows, module.in_features, dtype=module.weight.dtype)
        kernel = _best_time(lambda: module.kernel(x).to(x.dtype), repeats, flush)
        dense = _best_time(lambda: F.linear(x, module.weight, module.bias), repeats, flush)
        times.append(kernel)
        if kernel > dense * CLEAR_WIN:
            break
        width = rows
    return (width, times) if with_times else width


def _best_time(function, repeats, before=None):
    """The fastest of `repeats` calls after a warm-up, each after `before` (untimed): the
    engine's other threads (heartbeat, channels) run beside the load, and a median of a 100 us
    call moved with them (the down projection at one row came out packed in one load and dense
    in the next)."""
    function()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


class _CacheFlush:
    """A call that evicts whatever the CPU's caches hold: a read of a buffer twice the
    last-level cache (`bytes`), made once per load."""

    def __init__(self):
        self.bytes = 2 * last_level_cache_bytes()
        self.buffer = torch.ones(self.bytes // 4, dtype=torch.float32)

    def __call__(self):
        float(self.buffer.sum())



def last_level_cache_bytes(default=32 * 2**20):
    """The largest CPU cache's size (Linux's sysfs), or `default` where it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1))
        except (OSError, ValueError):
            continue
    return max(sizes, default=default)


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
