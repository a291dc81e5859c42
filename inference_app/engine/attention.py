"""Decode-step attention in float32 for a bfloat16 or float16 model on a CPU (SPEC 7a).

torch's CPU `scaled_dot_product_attention` is several times slower in bfloat16 than in float32
for the one-query shape of a decode step (one 576-wide SmolLM2 layer, 16 rows of 120 cached
tokens: 1.0 ms against 0.18 ms; bench/FINDINGS.md, "One thread for every forward pass; decode
attention in float32"), so at 16 rows attention took half of every step. `millm_sdpa` is
transformers' own SDPA attention, with the mask transformers builds for SDPA, except that a pass
of one query per row (a decode step) runs it on float32 copies of the query, keys and values and
rounds the output back to the model's dtype. A prefill (many queries per row) and every float32
model run exactly as under "sdpa".
"""

import torch
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


def use_for(model, device, dtype):
    """Switch a model that attends through SDPA to `millm_sdpa` where it is faster: a CPU
    running a 16-bit dtype. Returns the attention the model runs with."""
    if device.type == "cpu" and dtype != torch.float32 and model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
    return model.config._attn_implementation
