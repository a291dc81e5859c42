"""The engine's one call for a chunk of batch rows (issue 28): `run_rows`, in the model thread.

A row is any request the synchronous routes answer, parsed already (or the ApiError its route
would refuse it with). Rows run through the very service functions the routes call, or, with
`pack`, scoring and embedding rows many to a forward pass (packing.py). The caller (the batch
runner) chooses and claims the rows and records what comes back; the engine only runs them.
"""

import logging
from dataclasses import dataclass

from inference_app.engine import grammars, packing, services
from millm_lib.errors import ApiError, internal_error

log = logging.getLogger("millm.engine")


@dataclass(frozen=True, slots=True)
class RowRun:
    """What one row came to: the key it was submitted under, its ServiceResult or ApiError, and
    whether it ran in a pack."""

    key: object
    outcome: object
    packed: bool


def run_rows(runtime, rows, probes=None, pack=False, give_way=None, reuse=False):
    """`rows`: (key, parsed request or ApiError) pairs; `probes`: {key: the probe specs a
    probe-score row scores, or the ApiError it fails with}. Returns a RowRun per row run, in order.

    `give_way()` is asked before each single row after the first: when it says yes (a chat is
    waiting), the chunk ends there and only the rows before it are returned, the rest left for the
    next chunk. A chunk with packs runs whole (its packs are already computed). `reuse`: each
    pack's shared prefix from the engine's prefix cache (packing.py)."""
    outcomes = {key: parsed for key, parsed in rows if isinstance(parsed, ApiError)}
    packed = [(key, parsed) for key, parsed in rows
              if pack and not isinstance(parsed, ApiError) and services.is_packable(parsed)]
    if packed:
        try:
            for (key, _), outcome in zip(packed, packing.run_packed(runtime, [parsed for _, parsed in packed], reuse)):
                outcomes[key] = outcome
        except Exception:
            log.exception("a pack of %d rows failed; its rows run one at a time", len(packed))
            packed = []
    for index, (key, parsed) in enumerate(rows):
        if key in outcomes:
            continue
        if index and not packed and give_way is not None and give_way():
            rows = rows[:index]
            break
        outcomes[key] = _run_one(runtime, key, parsed, None if probes is None else probes[key])
    packed_keys = {key for key, _ in packed}
    return [RowRun(key, outcomes[key], key in packed_keys) for key, _ in rows]


def _run_one(runtime, key, parsed, probes):
    try:
        if isinstance(probes, ApiError):
            raise probes
        return services.run(runtime, parsed, probes=probes)
    except ApiError as error:
        return error
    except Exception:
        # A row that breaks the service must not break the batch (nor run forever).
        log.exception("row %s failed", key)
        return internal_error()


def check_grammar(runtime, response_format, param):
    """A row's grammar compiled at validation (cached: once per distinct schema), so that a
    schema the tokenizer cannot follow fails its line, with its number, before the batch runs."""
    grammars.compile_grammar(runtime, response_format, param)
