"""The batched KV cache: many sequences, one forward pass per decode step.

Rows are left-padded to one width: column j of every layer's keys and values is the same cache
position for every row, and a row's padding columns are masked out (attention mask 0) and never
read. Each row carries its own next position (its real length so far), so rotary embeddings see
exactly the positions the row would see alone.

A prompt joins alone: `prefill` runs it in a forward pass of its own (the same pass a lone
request runs, so its first token is the lone request's first token) and `admit` merges its cache
into the batch, padding whichever side is shorter. Prompts that join at the same step boundary
may instead share one pass (`prefill_together`, where the scheduler's policy says so): left-padded
to the longest, as the batch's rows are, one row each, so `admit` merges them all at once; a
padding column is masked in every layer, so each row's logits are its prompt's, to the
accumulation order of a wider matmul (not bit for bit: float32 keeps them alone). `drop` removes
rows and trims the padding columns no remaining row needs, so a long prompt that left stops
widening every step.

A step's new keys and values are written in place (`GrowingLayer`): each layer's keys are a view
of a buffer with room for more columns, grown by half again when full, where transformers' own
layer concatenates the whole cache every step (at 16 rows of 2,000 tokens, 700 MB copied a step
for a 135M model). `admit`, `drop` and `_widen` build new tensors, which the next step moves
into a buffer of their own.

Only attention layers whose cache is every key and value (`DynamicLayer`) can be merged this way.
A model with sliding-window layers (Gemma 2 and 3 mix them with global ones; Mistral and Qwen 2 may
use them) would keep only a window's last keys in those layers, a different count in each row, so
the decoder's own prefill keeps every layer whole (`DynamicCache()` without the config) and the
window is the mask's: the model builds its sliding mask from the column positions, and since every
row's real tokens end in the same column, a column's distance is a position's distance, so each
row attends to exactly the window it would alone. The cost is memory: a sliding layer holds the
whole context rather than the window. Layers that are not attention (a state space's or a linear
attention's states) cannot be merged: `batches` says so at load, and the scheduler decodes such a
model one sequence at a time.
"""

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache, DynamicLayer

from inference_app.engine.prefix_cache import block_floor, owner_of

# The layer kinds of a config's `layer_types` that the merged cache holds (as whole layers).
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def batches(config):
    """(whether the model's decode steps can share forward passes, the start-up line's words)."""
    config = config.get_text_config(decoder=True)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    others = kinds - ATTENTION_LAYERS
    if others:
        return False, (f"serial: its {', '.join(sorted(others))} layers keep states that cannot be merged "
                       "across sequences; one sequence decodes at a time")
    if "sliding_attention" in kinds or getattr(config, "sliding_window", None):
        return True, f"batched (sliding-window layers held whole, windowed by the mask; window {config.sliding_window})"
    return True, "batched"


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with room for more columns: a
    step writes its new column in place. A tensor assigned from outside (a merge, a drop) is not
    a view of this layer's buffers, so the next update copies it into new ones."""

    @classmethod
    def of(cls, layer):
        grown = cls()
        grown.__dict__.update(layer.__dict__)
        grown._buffers = None
        return grown

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        width = self.keys.shape[-2] + key_states.shape[-2]
        if not self._has_room(width):
            capacity = width + max(64, width // 2)
            self._buffers = (_buffer(self.keys, capacity), _buffer(self.values, capacity))
        keys, values = self._buffers
        start = self.keys.shape[-2]
        keys[:, :, start:width] = key_states
        values[:, :, start:width] = value_states
        self.keys, self.values = keys[:, :, :width], values[:, :, :width]
        return self.keys, self.values

    def _has_room(self, width):
        """Whether the keys and values are this layer's buffers' first columns, with room for `width`."""
        if self._buffers is None:
            return False
        keys, values = self._buffers
        return (keys.shape[-2] >= width and self.keys.data_ptr() == keys.data_ptr()
                and self.values.data_ptr() == values.data_ptr() and self.keys.shape[:2] == keys.shape[:2])


def _buffer(tensor, capacity):
    """A new [rows, heads, capacity, dim] buffer whose first columns hold `tensor`."""
    rows, heads, width, dim = tensor.shape
    buffer = tensor.new_empty((rows, heads, capacity, dim))
    buffer[:, :, :width] = tensor
    return buffer


class BatchedDecoder:
    def __init__(self, runtime):
        self.runtime = runtime
        self.device = runtime.device
        self.cache = None
        self.mask = None  # [rows, columns], 1 where a row has a real token
        self.positions = []  # each row's next position
        self.merges = None  # whether this model's cache merges (known after the first prefill)
        self.whole_layers = runtime.batches  # prefill into whole layers, to merge them
        # Steps write their keys in place, except in a compiled step (its shapes are its buckets').
        self.grows_in_place = self.whole_layers and not runtime.compiled

    @property
    def rows(self):
        return len(self.positions)

    @property
    def width(self):
        return 0 if self.mask is None else self.mask.shape[1]

    @torch.inference_mode()
    def prefill(self, prompt_ids):
        """One prompt alone: (its cache, the float32 logits at its last token)."""
        cache, logits, _ = self.prefill_reusing(prompt_ids, reuse=False)
        return cache, logits

    @torch.inference_mode()
    def prefill_reusing(self, prompt_ids, reuse=True):
        """`prefill`, and how many of the prompt's tokens a cached prefix held. With `reuse`
        (whole layers only), the prompt begins from the longest prefix of it the prefix cache
        holds, and leaves its own whole blocks there for the next prompt that begins the same
        way (a repeated system prompt, a chat's next turn): `reuse` true, or the batch's id they
        belong to (prefix_cache.PrefixCache.drop)."""
        prefix_cache = self.runtime.prefix_cache
        owner = owner_of(reuse)
        reuse = bool(reuse) and self.whole_layers and prefix_cache.enabled
        held = prefix_cache.longest(prompt_ids, len(prompt_ids) - 1) if reuse else None
        start = 0 if held is None else len(held.tokens)
        ids = torch.tensor([prompt_ids[start:]], dtype=torch.long, device=self.device)
        cache = {"cache": DynamicCache() if held is None else held.as_cache(1)} if self.whole_layers else {}
        out = self.runtime.model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache)
        if reuse:
            prefix_cache.count(start)
            keep = block_floor(len(prompt_ids) - 1)
            if keep > start:
                prefix_cache.put(prompt_ids[:keep], [(layer.keys[:, :, :keep], layer.values[:, :, :keep])
                                                     for layer in out.cache.layers], owner)
        return out.cache, out.logits[0, -1].float(), start

    @torch.inference_mode()
    def prefill_together(self, prompts):
        """Several prompts in one forward pass, left-padded to the longest (whole layers only):
        (their cache, one row each; their mask [rows, width], 1 on a prompt's tokens; the float32
        logits at each prompt's last token, [rows, vocab])."""
        width = max(len(prompt) for prompt in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # each row's own positions from its first token
        ids, mask, positions = ids.to(self.device), mask.to(self.device), positions.to(self.device)
        out = self.runtime.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=DynamicCache(),
                                 use_cache=True, logits_to_keep=1)
        return out.cache, mask, out.logits[:, -1].float()

    @staticmethod
    def mergeable(cache):
        return all(type(layer) is DynamicLayer for layer in cache.layers)

    @torch.inference_mode()
    def admit(self, cache, length, row_mask=None):
        """Merge a prefilled sequence's cache (`length` tokens) as the last row; or, with
        `row_mask` ([rows, width], `prefill_together`'s), the cache's rows as the last rows."""
        if row_mask is None:
            row_mask = torch.ones((1, length), dtype=torch.long, device=self.device)
        lengths = row_mask.sum(dim=1).tolist()
        if self.cache is None:
            for layer in cache.layers:  # a prefill leaves them transposed; a step's shapes want one layout
                layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
            if self.grows_in_place:
                cache.layers = [GrowingLayer.of(layer) for layer in cache.layers]
            self.cache, self.mask, self.positions = cache, row_mask, lengths
            return
        width = max(self.width, row_mask.shape[1])
        # Every new tensor first, assigned only once all exist: out of memory halfway leaves the
        # batch as it was.
        merged = [
            (torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)], dim=0),
             torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)], dim=0))
            for mine, theirs in zip(self.cache.layers, cache.layers)
        ]
        mask = torch.cat([_left_pad(self.mask, width), _left_pad(row_mask, width)], dim=0)
        for layer, (keys, values) in zip(self.cache.layers, merged):
            layer.keys, layer.values = keys, values
        self.mask = mask
        self.positions.extend(lengths)

    @torch.inference_mode()
    def step(self, token_ids):
        """One forward pass: each row's last sampled token in, [rows, vocab] float32 logits out."""
        if self.width < getattr(self.runtime.decode_forward, "min_columns", 1):
            self._widen(self.runtime.decode_forward.min_columns)
        ids = torch.tensor([[token_id] for token_id in token_ids], dtype=torch.long, device=self.device)
        positions = torch.tensor([[position] for position in self.positions], dtype=torch.long, device=self.device)
        mask = torch.cat([self.mask, torch.ones((self.rows, 1), dtype=torch.long, device=self.device)], dim=1)
        out = self.runtime.decode_forward(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=self.cache, use_cache=True,
            logits_to_keep=1,
        )
        self.mask = mask
        self.positions = [position + 1 for position in self.positions]
        return out.logits[:, -1].float()

    def _widen(self, width):
        """Masked padding columns on the left, so a compiled step sees its bucket's shapes."""
        for layer in self.cache.layers:
            layer.keys, layer.values = _left_pad(layer.keys, width), _left_pad(layer.values, width)
        self.mask = _left_pad(self.mask, width)

    @torch.inference_mode()
    def drop(self, indices):
        """Remove the rows at `indices`; trim the columns that are padding in every row left."""
        keep = [index for index in range(self.rows) if index not in set(indices)]
        if not keep:
            self.cache, self.mask, self.positions = None, None, []
            return
        self.positions = [self.positions[index] for index in keep]
        selected = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.mask = self.mask.index_select(0, selected)
        start = self.width - max(self.positions)  # a row's position is its real length
        self.mask = self.mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, selected)[:, :, start:].contiguous()
            layer.values = layer.values.index_select(0, selected)[:, :, start:].contiguous()


def _left_pad(tensor, width):
    """Zeros on the left of the sequence dimension (dim -2 of keys/values, dim 1 of a mask)."""
    if tensor.dim() == 2:
        return F.pad(tensor, (width - tensor.shape[1], 0))
    return F.pad(tensor, (0, 0, width - tensor.shape[-2], 0))
