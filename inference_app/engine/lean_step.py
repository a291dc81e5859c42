"""A decode step without transformers' module machinery, for the Llama family's layers.

A decode step at one to a few rows is small work in many small calls: on a 2-core CPU the
default model's one-row step took 26-28 ms, of which its 211 packed projections were 13.6 ms;
the rest is the elementwise operations and the Python around them: the hooks of 300 module
calls, keyword arguments passed down four levels, output-capturing decorators
(bench/FINDINGS.md, "An Intel Xeon without bfloat16").

`LeanStep` runs the same operations as the model's own forward pass, in the same order, on
the same modules and functions (the norms' arithmetic, the rotary embedding, the attention the
model is set to, the cache's `update`, the mask transformers builds), with none of the rest, so
its logits equal the model's bit for bit in every dtype (tests). It is the engine's eager decode
step (the scheduler's steps and the one-sequence loop's); prefills, scoring and embeddings run
the model's own forward. Modules are read at every step, so a weight edit or a packing change is
seen at the next one.

Which models: those whose every layer is transformers' Llama layer (`supports` says why not);
any other runs its own forward, as before.
"""

from dataclasses import dataclass

import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

# The model classes whose forward pass `LeanStep` reproduces, with their layers' and norms' classes.
SUPPORTED = {modeling_llama.LlamaForCausalLM: (modeling_llama.LlamaDecoderLayer, modeling_llama.LlamaRMSNorm)}


@dataclass
class StepOutput:
    logits: torch.Tensor
    cache: object


def supports(model):
    """(whether `LeanStep` reproduces this model's forward pass, the start-up line's words)."""
    kinds = SUPPORTED.get(type(model))
    if kinds is None:
        return False, f"{type(model).__name__}'s own forward (the lean step takes Llama's layers only)"
    layer_kind, norm_kind = kinds
    inner = model.model
    layers_match = all(type(layer) is layer_kind and type(layer.input_layernorm) is norm_kind
                       and type(layer.post_attention_layernorm) is norm_kind for layer in inner.layers)
    if not layers_match or type(inner.norm) is not norm_kind:
        return False, f"{type(model).__name__}'s own forward (its layers are not all Llama's)"
    if len(inner.layers) != inner.config.num_hidden_layers:
        return False, f"{type(model).__name__}'s own forward (its layer count differs from its config's)"
    return True, "the lean step (the model's own operations, without its module machinery)"


def _rms_norm(norm, hidden):
    """LlamaRMSNorm.forward, its operations in its order, without the module call."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


class LeanStep:
    """Called as the model is for a decode step; returns the logits and the cache it updated."""

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def __call__(self, input_ids, attention_mask=None, position_ids=None, cache=None, logits_to_keep=1, **_):
        inner = self.model.model
        config = inner.config
        hidden = inner.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + cache.get_seq_length()).unsqueeze(0)
        mask = create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
                                                       modeling_llama.eager_attention_forward)
        shape = hidden.shape[:-1]
        for index, layer in enumerate(inner.layers):
            attention = layer.self_attn
            heads = (*shape, -1, attention.head_dim)
            normed = _rms_norm(layer.input_layernorm, hidden)
            query = attention.q_proj(normed).view(heads).transpose(1, 2)
            key = attention.k_proj(normed).view(heads).transpose(1, 2)
            value = attention.v_proj(normed).view(heads).transpose(1, 2)
            query, key = modeling_llama.apply_rotary_pos_emb(query, key, cos, sin)
            key, value = cache.update(key, value, index)
            attended, _ = attend(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling)
            hidden = hidden + attention.o_proj(attended.reshape(*shape, -1).contiguous())
            normed = _rms_norm(layer.post_attention_layernorm, hidden)
            mlp = layer.mlp
            hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed))
        hidden = _rms_norm(inner.norm, hidden)
        return StepOutput(self.model.lm_head(hidden[:, -logits_to_keep:, :]), cache)
