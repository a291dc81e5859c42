"""Packed execution of scoring and embedding rows (SPEC 10, "Packing").

Rows become token sequences (one per prompt or input), sequences go into right-padded packs
bounded by BATCH_PACK_MAX_ROWS and BATCH_PACK_MAX_TOKENS (padded tokens), and each row's body is
built by the same builder as the single path. bfloat16 is not batch-invariant, so packing is
opt-in; in float32 packed and single agree to about 1e-6.
"""

import logging

import torch
from django.conf import settings

from inference_app.engine import services
from millm_lib.errors import ApiError
from millm_lib.limits import EMBEDDINGS

log = logging.getLogger("millm.engine")


def run_packed(runtime, parsed_rows):
    """Answer packable requests many to a forward pass; returns a ServiceResult or the ApiError
    of each, in order. A row the synchronous endpoint would refuse fails alone."""
    outcomes = [None] * len(parsed_rows)
    plans = {}
    for index, parsed in enumerate(parsed_rows):
        try:
            services.check_model(runtime, parsed)
            plans[index] = services.plan(runtime, parsed)
        except ApiError as error:
            outcomes[index] = error
    sequences = [(index, position, ids) for index, encoded in plans.items() for position, ids in enumerate(encoded)]
    outputs = {}
    for pack in packs(sequences, settings.BATCH_PACK_MAX_ROWS, settings.BATCH_PACK_MAX_TOKENS):
        for (index, position, _), output in zip(pack, forward(runtime, parsed_rows, pack)):
            outputs[(index, position)] = output
    for index, encoded in plans.items():
        try:
            row_outputs = [outputs[(index, position)] for position in range(len(encoded))]
            outcomes[index] = services.build(runtime, parsed_rows[index], encoded, row_outputs)
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


def forward(runtime, parsed_rows, pack):
    """One pack's forward pass; out of memory splits it in halves and retries, never fails it."""
    try:
        first = parsed_rows[pack[0][0]]
        sequences = [ids for _, _, ids in pack]
        if first.endpoint == EMBEDDINGS:
            # Embedding rows of one chunk may differ in pooling: group by it within the pack.
            return _embed_by_pooling(runtime, parsed_rows, pack)
        return runtime.packed_last_logits(sequences)
    except torch.OutOfMemoryError:
        if len(pack) == 1:
            raise
        log.warning("a pack of %d sequences ran out of memory; splitting it", len(pack))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        half = len(pack) // 2
        return forward(runtime, parsed_rows, pack[:half]) + forward(runtime, parsed_rows, pack[half:])


def _embed_by_pooling(runtime, parsed_rows, pack):
    results = [None] * len(pack)
    groups = {}
    for slot, (index, _, ids) in enumerate(pack):
        request = parsed_rows[index].request
        groups.setdefault((request.pooling, request.normalize), []).append((slot, ids))
    for (pooling, normalize), members in groups.items():
        vectors = runtime.packed_embed([ids for _, ids in members], pooling, normalize)
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
