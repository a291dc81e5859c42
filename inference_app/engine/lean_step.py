"""A decode step without transformers' module machinery, for the Llama and Gemma 3 layers.

A decode step at one to a few rows is small work in many small calls: on a 2-core CPU the
default model's one-row step took 26-28 ms, of which its 211 packed projections were 13.6 ms;
the rest is the elementwise operations and the Python around them: `nn.Module.__call__` for
about 300 modules, keyword arguments passed down four levels, output-capturing decorators
(bench/FINDINGS.md, "An Intel Xeon without bfloat16").

`LeanStep` performs the operations of the model's own forward pass, in the same order, with the
same functions and projection modules (the norms' and the layers' bodies written out, calling
the rotary embedding, the attention the model is set to, the cache's `update`, the masks
transformers builds), with none of the rest, so its logits equal the model's bit for bit (tests:
float32 and bfloat16). It is the engine's eager decode step (the scheduler's steps and the
one-sequence loop's); prefills, scoring and embeddings run the model's own forward. Modules are
read at every step, so a weight edit or a packing change is seen at the next one.

Three rewrites keep the bits and save operations: a layer's q, k and v, and its gate and up, run
as one packed call where they are packed alike (fused_projections.py: each output feature is
computed alone, so the parts equal the separate calls); a Llama layer rotates its query and key
heads in one pass over that joined output (apply_rotary_pos_emb's operations, elementwise); and
Llama's norm is `F.rms_norm` on the float32 states, its arithmetic to the bit in one operation.

Which models: a family below whose every layer and norm is the family's own class, attending by
SDPA (`millm_sdpa` included) or eagerly (`supports` says why not); and since the bodies are
copied from one transformers release, `eager_step` runs one step both ways at load and keeps the
model's own forward unless the logits are equal to the bit.
"""

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama

from inference_app.engine import attention as millm_attention
from inference_app.engine.fused_projections import Siblings

# The attention implementations whose functions take nothing from the arguments the lean step
# leaves out (position ids, `use_cache`): flash attention reads position ids, so it is not here.
ATTENTIONS = frozenset({"sdpa", "eager", millm_attention.NAME})


@dataclass
class StepOutput:
    logits: torch.Tensor
    cache: object


def _llama_norm(norm, hidden):
    """LlamaRMSNorm.forward without the module call: `F.rms_norm` of the float32 states is its
    `x * rsqrt(mean(x^2) + eps)` to the bit, in one operation for five."""
    normed = F.rms_norm(hidden.to(torch.float32), hidden.shape[-1:], eps=norm.variance_epsilon)
    return norm.weight * normed.to(hidden.dtype)


def _gemma3_norm(norm, hidden):
    """Gemma3RMSNorm.forward: (x * w) rounded, where Llama rounds x before the weight."""
    normed = hidden.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (normed * (1.0 + norm.weight.float())).type_as(hidden)


def _mlp(mlp, gate_up, hidden):
    gate, up = gate_up(hidden)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def _projected(attention, qkv, hidden):
    """The query, keys and values [rows, heads, tokens, head_dim] of the normed hidden states."""
    heads = (*hidden.shape[:-1], -1, attention.head_dim)
    return tuple(projected.view(heads).transpose(1, 2) for projected in qkv(hidden))


def _rotated_together(attention, widths, together, cos, sin):
    """The query, keys and values from q, k and v's outputs side by side: the query's and the
    keys' heads rotated in one pass (apply_rotary_pos_emb's operations on both at once)."""
    heads = together.view(*together.shape[:-1], -1, attention.head_dim).transpose(1, 2)
    queries, keys = widths[0] // attention.head_dim, widths[1] // attention.head_dim
    turned = heads[:, :queries + keys]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    turned = (turned * cos) + (modeling_llama.rotate_half(turned) * sin)
    return turned[:, :queries], turned[:, queries:], heads[:, queries + keys:]


class _Llama:
    layer = modeling_llama.LlamaDecoderLayer
    norm_class = modeling_llama.LlamaRMSNorm
    norms = ("input_layernorm", "post_attention_layernorm")
    attention_norms = ()
    norm = staticmethod(_llama_norm)
    rotate = staticmethod(modeling_llama.apply_rotary_pos_emb)
    eager = staticmethod(modeling_llama.eager_attention_forward)

    @staticmethod
    def masks_and_rotary(inner, hidden, attention_mask, cache, position_ids):
        """Each layer's (mask, (cos, sin)), as LlamaModel.forward builds them."""
        mask = create_causal_mask(config=inner.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  cache=cache, position_ids=position_ids)
        rotary = inner.rotary_emb(hidden, position_ids=position_ids)
        return [(mask, rotary)] * len(inner.layers)

    @classmethod
    def layer_step(cls, layer, index, hidden, mask, rotary, cache, attend, qkv, gate_up):
        attention = layer.self_attn
        normed = cls.norm(layer.input_layernorm, hidden)
        together = qkv.together(normed)
        if together is None:
            query, key, value = _projected(attention, qkv, normed)
            query, key = cls.rotate(query, key, *rotary)
        else:
            query, key, value = _rotated_together(attention, qkv.widths, together, *rotary)
        key, value = cache.update(key, value, index)
        attended, _ = attend(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling)
        hidden = hidden + attention.o_proj(attended.reshape(*hidden.shape[:-1], -1).contiguous())
        return hidden + _mlp(layer.mlp, gate_up, cls.norm(layer.post_attention_layernorm, hidden))

    @staticmethod
    def logits(model, hidden):
        return model.lm_head(hidden)


class _Gemma3:
    layer = modeling_gemma3.Gemma3DecoderLayer
    norm_class = modeling_gemma3.Gemma3RMSNorm
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    attention_norms = ("q_norm", "k_norm")
    norm = staticmethod(_gemma3_norm)
    rotate = staticmethod(modeling_gemma3.apply_rotary_pos_emb)
    eager = staticmethod(modeling_gemma3.eager_attention_forward)

    @staticmethod
    def masks_and_rotary(inner, hidden, attention_mask, cache, position_ids):
        """Each layer's (mask, (cos, sin)) for its layer type, as Gemma3TextModel.forward builds them."""
        config = inner.config
        arguments = dict(config=config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                         position_ids=position_ids)
        masks = {"full_attention": create_causal_mask(**arguments),
                 "sliding_attention": create_sliding_window_causal_mask(**arguments)}
        rotary = {kind: inner.rotary_emb(hidden, position_ids, kind) for kind in set(config.layer_types)}
        return [(masks[kind], rotary[kind]) for kind in config.layer_types[:len(inner.layers)]]

    @classmethod
    def layer_step(cls, layer, index, hidden, mask, rotary, cache, attend, qkv, gate_up):
        attention = layer.self_attn
        query, key, value = _projected(attention, qkv, cls.norm(layer.input_layernorm, hidden))
        query, key = cls.norm(attention.q_norm, query), cls.norm(attention.k_norm, key)
        query, key = cls.rotate(query, key, *rotary)
        key, value = cache.update(key, value, index)
        attended, _ = attend(attention, query, key, value, mask, dropout=0.0, scaling=attention.scaling,
                             sliding_window=attention.sliding_window)
        attended = attention.o_proj(attended.reshape(*hidden.shape[:-1], -1).contiguous())
        hidden = hidden + cls.norm(layer.post_attention_layernorm, attended)
        fed = _mlp(layer.mlp, gate_up, cls.norm(layer.pre_feedforward_layernorm, hidden))
        return hidden + cls.norm(layer.post_feedforward_layernorm, fed)

    @staticmethod
    def logits(model, hidden):
        logits = model.lm_head(hidden)
        capping = model.config.final_logit_softcapping
        if capping is not None:
            logits = torch.tanh(logits / capping) * capping
        return logits


FAMILIES = {modeling_llama.LlamaForCausalLM: _Llama, modeling_gemma3.Gemma3ForCausalLM: _Gemma3}


def supports(model):
    """(whether `LeanStep` reproduces this model's forward pass, the start-up line's words)."""
    name = type(model).__name__
    family = FAMILIES.get(type(model))
    if family is None:
        return False, f"{name}'s own forward (the lean step takes Llama's and Gemma 3's layers)"
    inner = model.model
    norms = [inner.norm] + [getattr(layer, norm) for layer in inner.layers for norm in family.norms] + [
        getattr(layer.self_attn, norm) for layer in inner.layers for norm in family.attention_norms]
    if not all(type(layer) is family.layer for layer in inner.layers) or not all(
            type(norm) is family.norm_class for norm in norms):
        return False, f"{name}'s own forward (its layers are not all its family's own)"
    if len(inner.layers) != inner.config.num_hidden_layers:
        return False, f"{name}'s own forward (its layer count differs from its config's)"
    if getattr(inner.config, "use_bidirectional_attention", False):
        return False, f"{name}'s own forward (its attention is bidirectional)"
    kind = model.config._attn_implementation
    if kind not in ATTENTIONS:
        return False, f"{name}'s own forward (the lean step does not take {kind} attention)"
    return True, "the lean step (the model's own operations, without its module machinery)"


class LeanStep:
    """Called as the model is for a decode step; returns the logits and the cache it updated."""

    def __init__(self, model):
        """Made once the model is packed (`ResidentModel.serve`): each layer's q, k and v, and its
        gate and up, run as one call where they are packed alike (fused_projections.py)."""
        self.model = model
        self.family = FAMILIES[type(model)]
        self.siblings = [(Siblings((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
                          Siblings((layer.mlp.gate_proj, layer.mlp.up_proj))) for layer in model.model.layers]

    @torch.inference_mode()
    def __call__(self, input_ids, cache, attention_mask=None, position_ids=None, logits_to_keep=1, use_cache=True):
        """A decode step's arguments as the model takes them (`cache` is required: it is updated)."""
        inner, family = self.model.model, self.family
        hidden = inner.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + cache.get_seq_length()).unsqueeze(0)
        per_layer = family.masks_and_rotary(inner, hidden, attention_mask, cache, position_ids)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(inner.config._attn_implementation, family.eager)
        for index, (layer, (mask, rotary), (qkv, gate_up)) in enumerate(zip(inner.layers, per_layer, self.siblings)):
            hidden = family.layer_step(layer, index, hidden, mask, rotary, cache, attend, qkv, gate_up)
        hidden = family.norm(inner.norm, hidden)
        return StepOutput(family.logits(self.model, hidden[:, -logits_to_keep:, :]), cache)


def eager_step(model):
    """(the decode step to run eagerly, the start-up line's words): the lean step where the model
    is supported and one step from the same short prefill gives the model's logits to the bit,
    else the model itself."""
    supported, words = supports(model)
    if not supported:
        return model, words
    lean = LeanStep(model)
    if not _agrees(model, lean):
        return model, f"{type(model).__name__}'s own forward (the lean step's logits differed from it at load)"
    return lean, words


@torch.inference_mode()
def _agrees(model, lean):
    """One step both ways from copies of one prefill of three tokens: equal logits, to the bit."""
    ids = torch.tensor([[1, 2, 3]], device=model.device)
    prefilled = model(input_ids=ids, cache=DynamicCache(), use_cache=True, logits_to_keep=1).cache
    theirs, mine = prefilled, copy.deepcopy(prefilled)
    expected = model(input_ids=ids[:, -1:], cache=theirs, use_cache=True, logits_to_keep=1).logits
    return torch.equal(lean(input_ids=ids[:, -1:], cache=mine).logits, expected)
