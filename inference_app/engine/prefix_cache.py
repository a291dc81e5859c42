"""Shared prefixes computed once (issue 45): the keys and values of token prefixes, kept and found
again by the longest common token prefix.

A prefix is cut at whole blocks of BLOCK_TOKENS tokens, and each block boundary has a key that
chains the block's tokens to the key before it (vLLM's block hashes): looking a prompt up walks its
boundaries and keeps the longest one held, whose tokens are compared before use (a hash is not
proof). A held prefix serves every shorter whole-block prefix of itself too. An entry holds every layer's keys and values of its prefix for one row, as one forward pass
alone over those tokens left them; `as_cache(rows)` hands them on as a transformers `DynamicCache`
of whole layers (the batched decoder's kind: a sliding window is the mask's), every row the same
prefix, and the forward pass that continues from it concatenates new tensors, never writing the
held ones.

The cache lives on the resident model, so a load or a swap drops it with the model; a weight edit
clears it (`ResidentModel.weights_changed`). It is bounded in bytes (MILLM_PREFIX_CACHE_MB) and
drops the least recently used entries first.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

BLOCK_TOKENS = 8

_reused = {"tokens": 0}  # this process's prompt tokens served from a held prefix, every model's
_reused_lock = threading.Lock()


def tokens_reused_total():
    """What the engine's heartbeat reports (`/metrics`: millm_prefix_tokens_reused_total)."""
    return _reused["tokens"]


def block_floor(length):
    return length - length % BLOCK_TOKENS


def common_prefix_length(sequences):
    """How many leading tokens every one of `sequences` shares."""
    first = sequences[0]
    length = min(len(sequence) for sequence in sequences)
    for sequence in sequences[1:]:
        same = 0
        limit = min(length, len(sequence))
        while same < limit and sequence[same] == first[same]:
            same += 1
        length = same
    return length


def reusable_length(sequences):
    """The shared prefix a group of sequences may run once: whole blocks, and every sequence keeps
    at least its last token to run on its own (its logits, its pooled vector, its first sampled
    token come from that pass). 0 when no whole block is shared."""
    shortest = min(len(sequence) for sequence in sequences)
    return block_floor(min(common_prefix_length(sequences), shortest - 1))


@dataclass(eq=False)
class CachedPrefix:
    tokens: tuple
    layers: list  # [(keys, values)] per layer, each [1, heads, len(tokens), head dim]
    nbytes: int
    keys: tuple = ()  # its block boundaries' keys, while held
    owner: object = None  # the batch that computed it (dropped when the batch ends), or None

    def as_cache(self, rows=1):
        """A DynamicCache holding this prefix for `rows` rows (new tensors: the held ones are never
        written)."""
        cache = DynamicCache()
        for index, (keys, values) in enumerate(self.layers):
            cache.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), index)
        return cache

    def first(self, length):
        """The first `length` tokens of this prefix (views of its tensors, not held on their own)."""
        if length == len(self.tokens):
            return self
        return CachedPrefix(self.tokens[:length], [(keys[:, :, :length], values[:, :, :length])
                                                   for keys, values in self.layers], 0)


class PrefixCache:
    """Prefixes by block-chained key, least recently used first; bounded by `limit_bytes` (0: off).

    Every block boundary of a held prefix is indexed, so a prompt that parts from a held prefix
    halfway through it still reuses the blocks before the parting (as vLLM's per-block hashes
    and SGLang's radix tree do); the held tensors are shared, sliced, not copied."""

    def __init__(self, limit_bytes):
        self.limit_bytes = limit_bytes
        self._held = OrderedDict()  # id(entry) -> CachedPrefix, least recently used first
        self._boundaries = {}  # block-chained key -> the held entries whose tokens pass that boundary, newest last
        self._lock = threading.Lock()
        self.nbytes = 0
        self.revision = 0  # the weights' edits seen: every key chains from it

    @property
    def enabled(self):
        return self.limit_bytes > 0

    def __len__(self):
        return len(self._held)

    def _chain(self, tokens, upto):
        key = self.revision
        for end in range(BLOCK_TOKENS, upto + 1, BLOCK_TOKENS):
            key = hash((key, tuple(tokens[end - BLOCK_TOKENS:end])))
            yield end, key

    def longest(self, tokens, upto=None):
        """The longest held prefix of `tokens` (at most `upto` tokens, whole blocks), or None."""
        upto = block_floor(len(tokens) if upto is None else min(upto, len(tokens)))
        found = None
        checked = 0  # how many of `found`'s tokens are compared already: each boundary compares only its block
        with self._lock:
            for end, key in self._chain(tokens, upto):
                holders = self._boundaries.get(key)
                entry = holders[-1] if holders else None
                if found is None or entry is not found[1]:
                    checked = 0  # another holder from here on: compare its tokens from the first
                if entry is None or entry.tokens[checked:end] != tuple(tokens[checked:end]):
                    break  # a later boundary chains from this one: none can match
                found, checked = (end, entry), end
            if found is None:
                return None
            end, entry = found
            self._held.move_to_end(id(entry))
        return entry.first(end)

    def put(self, tokens, layers, owner=None):
        """Hold `layers` (each layer's keys and values of exactly `tokens`, one row, a whole number
        of blocks) as the prefix `tokens` (`owner`: the batch it is computed for, see `drop`); the
        least recently used entries go while the bound is passed. Returns the entry (held, or not
        when it alone is over the bound)."""
        tokens = tuple(tokens)
        layers = [(keys[:1].detach().clone(), values[:1].detach().clone()) for keys, values in layers]
        entry = CachedPrefix(tokens, layers, sum(keys.nbytes + values.nbytes for keys, values in layers), owner=owner)
        if entry.nbytes > self.limit_bytes:
            return entry
        with self._lock:
            entry.keys = tuple(key for _, key in self._chain(tokens, len(tokens)))
            for key in entry.keys:
                self._boundaries.setdefault(key, []).append(entry)
            self._held[id(entry)] = entry
            self.nbytes += entry.nbytes
            while self.nbytes > self.limit_bytes:
                self._forget(next(iter(self._held.values())))
        return entry

    def drop(self, owner):
        """A batch ended (completed, cancelled, expired): the prefixes it computed go now, not when
        the bound pushes them out. Returns how many went."""
        with self._lock:
            owned = [entry for entry in self._held.values() if entry.owner == owner]
            for entry in owned:
                self._forget(entry)
        return len(owned)

    def _forget(self, entry):
        del self._held[id(entry)]
        self.nbytes -= entry.nbytes
        for key in entry.keys:
            holders = self._boundaries[key]
            holders.remove(entry)
            if not holders:
                del self._boundaries[key]

    def clear(self):
        """The weights changed: nothing held answers for them any more."""
        with self._lock:
            self._held.clear()
            self._boundaries.clear()
            self.nbytes = 0
            self.revision += 1

    @staticmethod
    def count(tokens):
        """`tokens` of prompts were a held prefix's, not run again."""
        with _reused_lock:
            _reused["tokens"] += tokens


def owner_of(reuse):
    """Who a prefix computed under `reuse` belongs to: a batch's id, or nobody (True: an
    interactive request's)."""
    return None if reuse is True else reuse


@torch.inference_mode()
def prefix_for(runtime, tokens, owner=None):
    """The cached prefix of exactly `tokens` (a whole number of blocks): found, or computed from
    the longest held prefix of it (or from nothing) in one forward pass alone, and held (for
    `owner`, a batch's id, or nobody)."""
    cache = runtime.prefix_cache
    held = cache.longest(tokens)
    if held is not None and len(held.tokens) == len(tokens):
        return held
    start = 0 if held is None else len(held.tokens)
    past = DynamicCache() if held is None else held.as_cache(1)
    ids = torch.tensor([list(tokens[start:])], dtype=torch.long, device=runtime.device)
    runtime.model.base_model(input_ids=ids, cache=past, use_cache=True)
    return cache.put(tokens, [(layer.keys, layer.values) for layer in past.layers], owner)
