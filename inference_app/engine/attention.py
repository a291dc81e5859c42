"""Decode-step attention in float32 for a bfloat16 or float16 model on a CPU, where that is faster
(SPEC 7a).

On an AMD EPYC torch's CPU `scaled_dot_product_attention` was several times slower in bfloat16
than in float32 for the one-query shape of a decode step (one 576-wide SmolLM2 layer, 16 rows of
120 cached tokens: 1.0 ms against 0.18 ms; bench/FINDINGS.md, "One thread for every forward pass;
decode attention in float32"), so at 16 rows attention took half of every step. On an Intel Xeon
with AMX it is the other way round (the same 16 rows: 0.14 ms in bfloat16, 0.97 ms for float32
copies and their attention; "The Intel Xeon with AMX again"), so
`use_for` chooses by timing both at load (ENGINE_DECODE_ATTENTION). `millm_sdpa` is
transformers' own SDPA attention, with the mask transformers builds for SDPA, except that a pass
of one query per row (a decode step) runs it on float32 copies of the query, keys and values and
rounds the output back to the model's dtype. A prefill (many queries per row) and every float32
model run exactly as under "sdpa".
"""

import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "millm_sdpa"


def attention(module, query, key, value, attention_mask, **kwargs):
    if query.shape[2] == 1 and query.dtype != torch.float32:
        output, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                 **kwargs)
        return output.to(query.dtype), weights
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_for(model, device, dtype, setting="auto"):
    """(the attention the model runs with, why): a 16-bit model on a CPU that attends through
    SDPA switches to `millm_sdpa` where `setting` (ENGINE_DECODE_ATTENTION) says: `float32`;
    `model` keeps transformers' sdpa in the model's dtype; `auto` times both for the model's
    heads and keeps whichever is clearly faster on this CPU, float32 at a tie."""
    kind = model.config._attn_implementation
    if device.type != "cpu" or dtype == torch.float32 or kind != "sdpa":
        return kind, ""
    if setting == "auto":
        mine, theirs = _decode_times(model.config, dtype)
        setting = "model" if theirs <= CLEAR_WIN * mine else "float32"
        why = f"{dtype_name(dtype)} {theirs * 1e6:.0f} us, float32 {mine * 1e6:.0f} us a layer at 1 and 8 rows, timed"
    else:
        why = "ENGINE_DECODE_ATTENTION"
    if setting == "float32":
        model.set_attn_implementation(NAME)
        return NAME, f"decode steps in float32: {why}"
    return kind, f"decode steps in {dtype_name(dtype)}: {why}"


# The model's dtype must take at most this share of float32's time to be chosen.
CLEAR_WIN = 0.9
# (rows, cached tokens) of the decode steps `auto` times.
TIMED_SHAPES = ((1, 256), (8, 128))


def dtype_name(dtype):
    """"bfloat16" for torch.bfloat16: the name the settings, the start-up lines and the
    fingerprint use."""
    return str(dtype).removeprefix("torch.")


def _decode_times(config, dtype, repeats=7):
    """(float32's, the model dtype's) best seconds for one layer's decode attention, summed over
    TIMED_SHAPES, the two interleaved."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    generator = torch.Generator().manual_seed(0)
    mine = theirs = 0.0
    for rows, length in TIMED_SHAPES:
        query = torch.randn(rows, heads, 1, head_dim, generator=generator).to(dtype)
        key, value = (torch.randn(rows, kv_heads, length, head_dim, generator=generator).to(dtype) for _ in range(2))

        def in_float32():
            F.scaled_dot_product_attention(query.float(), key.float(), value.float(), enable_gqa=True).to(dtype)

        def in_dtype():
            F.scaled_dot_product_attention(query, key, value, enable_gqa=True)

        best = [float("inf"), float("inf")]
        for _ in range(repeats):
            for index, function in enumerate((in_float32, in_dtype)):
                started = time.perf_counter()
                function()
                best[index] = min(best[index], time.perf_counter() - started)
        mine, theirs = mine + best[0], theirs + best[1]
    return mine, theirs
