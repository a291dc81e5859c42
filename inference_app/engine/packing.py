"""Packed execution of scoring and embedding rows (SPEC 10, "Packing").

Rows become token sequences (one per prompt or input), sequences go into right-padded packs
bounded by BATCH_PACK_MAX_ROWS and BATCH_PACK_MAX_TOKENS (padded tokens), and each row's body is
built by the same builder as the single path. bfloat16 is not batch-invariant, so packing is
opt-in; in float32 packed and single agree to about 1e-6.

With `reuse` (a batch's `prefix_reuse`), a pack's shared prefix (whole blocks of tokens every
sequence begins with) runs once, or not at all when the engine's prefix cache holds it from an
earlier pack, chunk or request (prefix_cache.py); each sequence then runs only what follows it.
A row says how many of its tokens were reused in `usage.prompt_tokens_details.cached_tokens`.
"""

import logging

import torch
from django.conf import settings

from inference_app.engine import prefix_cache, services
from millm_lib.errors import ApiError
from millm_lib.limits import EMBEDDINGS

log = logging.getLogger("millm.engine")


def run_packed(runtime, parsed_rows, reuse=False):
    """Answer packable requests many to a forward pass; returns a ServiceResult or the ApiError
    of each, in order. A row the synchronous endpoint would refuse fails alone. `reuse` (true,
    or the batch's id the prefixes it computes belong to): each pack's shared prefix from the
    prefix cache."""
    outcomes = [None] * len(parsed_rows)
    plans = {}
    for index, parsed in enumerate(parsed_rows):
        try:
            services.check_model(runtime, parsed)
            plans[index] = services.plan(runtime, parsed)
        except ApiError as error:
            outcomes[index] = error
    sequences = [(index, position, ids) for index, encoded in plans.items() for position, ids in enumerate(encoded)]
    outputs, reused = {}, {}
    for pack in packs(sequences, settings.BATCH_PACK_MAX_ROWS, settings.BATCH_PACK_MAX_TOKENS):
        for (index, position, _), (output, tokens) in zip(pack, forward(runtime, parsed_rows, pack, reuse)):
            outputs[(index, position)] = output
            reused[index] = reused.get(index, 0) + tokens
    for index, encoded in plans.items():
        try:
            row_outputs = [outputs[(index, position)] for position in range(len(encoded))]
            outcomes[index] = services.with_reuse(services.build(runtime, parsed_rows[index], encoded, row_outputs),
                                                  reused.get(index, 0))
        except ApiError as error:
            outcomes[index] = error
    return outcomes


def packs(sequences, max_rows, max_tokens):
    """Consecutive groups of at most `max_rows` sequences whose padded size (rows x the longest)
    stays within `max_tokens`; a sequence longer than the budget runs alone."""
    group, width = [], 0
    for item in sequences:
        length = len(item[2])
        if group and (len(group) >= max_rows or (len(group) + 1) * max(width, length) > max_tokens):
            yield group
            group, width = [], 0
        group.append(item)
        width = max(width, length)
    if group:
        yield group


def forward(runtime, parsed_rows, pack, reuse=False):
    """One pack's forward pass: (output, prefix tokens reused) per sequence. Out of memory
    splits it in halves and retries, never fails it."""
    try:
        first = parsed_rows[pack[0][0]]
        sequences = [ids for _, _, ids in pack]
        if first.endpoint == EMBEDDINGS:
            # Embedding rows of one chunk may differ in pooling: group by it within the pack.
            return _embed_by_pooling(runtime, parsed_rows, pack, reuse)
        return _by_prefix(runtime, sequences, reuse, runtime.packed_last_logits)
    except torch.OutOfMemoryError:
        if len(pack) == 1:
            raise
        log.warning("a pack of %d sequences ran out of memory; splitting it", len(pack))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = len(pack) // 2
        return forward(runtime, parsed_rows, pack[:half], reuse) + forward(runtime, parsed_rows, pack[half:], reuse)


def _by_prefix(runtime, sequences, reuse, run):
    """`run(sequences, prefix)` over the pack, as (output, prefix tokens reused) per sequence.
    With `reuse`, sequences that begin with the same block run together after their shared
    prefix (held, or computed once now); a sequence that shares no block with the rest of its
    pack runs after the longest prefix of it the cache holds, if any."""
    if not (reuse and runtime.prefix_cache.enabled):
        return [(output, 0) for output in run(sequences, None)]
    groups = {}
    for index, ids in enumerate(sequences):
        groups.setdefault(tuple(ids[:prefix_cache.BLOCK_TOKENS]), []).append(index)
    results = [None] * len(sequences)
    for members in groups.values():
        group = [sequences[index] for index in members]
        prefix = shared_prefix(runtime, group, prefix_cache.owner_of(reuse))
        tokens = 0 if prefix is None else len(prefix.tokens)
        for index, output in zip(members, run(group, prefix)):
            results[index] = (output, tokens)
    return results


def shared_prefix(runtime, sequences, owner=None):
    """The CachedPrefix `sequences` all begin with (whole blocks; each keeps a token of its own):
    held, or (two or more sequences) computed once now from the longest held part; None when
    there is none."""
    length = prefix_cache.reusable_length(sequences)
    if len(sequences) == 1:
        prefix = runtime.prefix_cache.longest(sequences[0], length)
    else:
        prefix = prefix_cache.prefix_for(runtime, sequences[0][:length], owner) if length else None
    if prefix is not None:
        runtime.prefix_cache.count(len(prefix.tokens) * len(sequences))
    return prefix


def _embed_by_pooling(runtime, parsed_rows, pack, reuse):
    results = [None] * len(pack)
    groups = {}
    for slot, (index, _, ids) in enumerate(pack):
        request = parsed_rows[index].request
        groups.setdefault((request.pooling, request.normalize), []).append((slot, ids))
    for (pooling, normalize), members in groups.items():
        # Only `last` pooling reads nothing of the prefix's own hidden states.
        vectors = _by_prefix(runtime, [ids for _, ids in members], reuse if pooling == "last" else False,
                             lambda group, prefix: runtime.packed_embed(group, pooling, normalize, prefix))
        for (slot, _), vector in zip(members, vectors):
            results[slot] = vector
    return results


def sequence_length(runtime, parsed):
    """The longest sequence a row runs: what length-aware packing sorts by."""
    try:
        return max(len(ids) for ids in services.plan(runtime, parsed))
    except ApiError:
        return 0


def choose_pack(window, length_of, max_rows):
    """Length-aware packing: of a window of rows (in file order), the `max_rows` shortest, ties
    in file order. Called again on what is left, it groups rows of similar length together."""
    ranked = sorted(enumerate(window), key=lambda pair: (length_of(pair[1]), pair[0]))
    return [item for _, item in ranked[:max_rows]]
