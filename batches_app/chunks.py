"""Chunks of batch rows: which rows run next, and the rows' results from the engine's run.

- `PendingRow`: a row about to run, its body parsed once.
- `RowMemo`: the rows seen but not yet run, parsed (and measured) once.
- `pick_chunk`: pure: of a window of claimable rows in line order, the rows the next chunk runs.
- `execute_rows`: in the model thread, the rows through the engine's one call for rows
  (`inference_app.engine.rows.run_rows`), each outcome made the RowResult `record_chunk` writes.
"""

import logging
import time
from dataclasses import dataclass

from batches_app.models import BatchRow, RowResult
from inference_app.engine import packing, services
from inference_app.engine.rows import run_rows
from inference_app.schemas import parse_request
from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from millm_lib.limits import GENERATION_ENDPOINTS, PACKABLE_ENDPOINTS, PROBE_SCORE, RESPONSES
from responses_app.requests import renamed
from responses_app.rows import engine_request, row_answer, row_usage

# One line per chunk executed: its batch, the engine, the lines that produced a result and the
# moment they had (epoch seconds), logged before any record: a line executed after its
# recorded_at ran again (MILLM_LOG_EXECUTIONS; the tests count executions with it).
executions = logging.getLogger("millm.batches.executions")


@dataclass(frozen=True, slots=True)
class PendingRow:
    """A row about to run, its body parsed once: its kind, its length, its probes and its run
    all read `parsed`, the request the engine runs or the ApiError the route would refuse it
    with. `asked`: a /v1/responses row's own request, which its chat answer is recorded as."""

    row: BatchRow
    parsed: object
    asked: object = None

    @classmethod
    def of(cls, endpoint, row):
        try:
            parsed = parse_request(endpoint, row.body, strict=True)
            return cls(row, engine_request(parsed), parsed.request if endpoint == RESPONSES else None)
        except ApiError as error:
            return cls(row, error)

    @property
    def refused(self):
        return isinstance(self.parsed, ApiError)

    @property
    def choices(self):
        """The sequences the row decodes (its `n`): the seats it holds, seated."""
        return 1 if self.refused else getattr(self.parsed.request, "n", 1)

    @property
    def generates(self):
        """A chat or completion row that generates (not scoring), as the service functions
        decide (`logprobs: 0` is scoring in completions, not in chat): it runs alone, or seated.
        A refused row does not: it fails in a chunk of its own, as the route would refuse it."""
        return not self.refused and services.is_generation(self.parsed)


class RowMemo:
    """Rows seen but not yet run, for the batch in hand: a row waiting in the packing window, or
    the scoring row that ended a run of seated ones, is parsed (and measured) once."""

    def __init__(self):
        self.parsed = {}  # row id -> PendingRow
        self.lengths = {}  # row id -> token length, for length-aware packing

    def clear(self):
        self.parsed.clear()
        self.lengths.clear()

    def pending(self, endpoint, row):
        if row.pk not in self.parsed:
            self.parsed[row.pk] = PendingRow.of(endpoint, row)
        return self.parsed[row.pk]

    def length(self, runtime, endpoint, row):
        if row.pk not in self.lengths:
            pending = self.pending(endpoint, row)
            self.lengths[row.pk] = 0 if pending.refused else packing.sequence_length(runtime, pending.parsed)
        return self.lengths[row.pk]

    def taken(self, endpoint, claimed, chosen):
        """The PendingRows of `claimed` (the chosen rows we claimed, with their claim's token);
        every chosen row leaves the memo (run now, or another replica's)."""
        taken = []
        for row in claimed:
            # The claimed instance carries the claim's token, which its record is fenced by; a row
            # parsed earlier keeps only its parsed body.
            parsed = self.parsed.get(row.pk)
            taken.append(PendingRow(row, parsed.parsed, parsed.asked) if parsed else PendingRow.of(endpoint, row))
        for row in chosen:
            self.parsed.pop(row.pk, None)
            self.lengths.pop(row.pk, None)
        return taken


def window_size(batch, chunk_rows, pack_max_rows):
    """How many claimable rows the next chunk chooses from: one probe-score row; a packing window
    (`pack_window`, or a pack's most rows) when packing; else a chunk's rows."""
    if batch.endpoint == PROBE_SCORE:
        return 1
    if batch.pack and batch.endpoint in PACKABLE_ENDPOINTS:
        return batch.pack_window or pack_max_rows
    return chunk_rows


def pick_chunk(batch, window, generates, length, pack_max_rows):
    """Of `window` (claimable rows in line order), the rows the next chunk runs: a generation row
    alone; the whole window; or, length-aware packing (`pack_window`), the rows of most similar
    length (each still recorded on its own line, so the output stays in order). `generates(row)`
    and `length(row)` read the memo."""
    if not window:
        return []
    if batch.endpoint in GENERATION_ENDPOINTS and generates(window[0]):
        return window[:1]
    if not (batch.pack and batch.endpoint in PACKABLE_ENDPOINTS and batch.pack_window):
        return window
    return packing.choose_pack(window, length, pack_max_rows)


def seated_rows(window, generates):
    """Of `window` (claimable rows not in flight, in line order), the generation rows that start
    in seats now: up to the first row that does not generate, which runs in a chunk of its own
    once the rows in flight are done."""
    rows = []
    for row in window:
        if not generates(row):
            break
        rows.append(row)
    return rows


def execute_rows(runtime, endpoint, rows, probes=None, pack=False, give_way=None, reuse=False):
    """In the model thread: `rows` (PendingRows) through the engine's run (`run_rows`, which says
    what `pack`, `give_way` and `reuse` do); a RowResult per row run. `probes`: {row id: specs or error}."""
    runs = run_rows(runtime, [(pending.row.pk, pending.parsed) for pending in rows], probes, pack, give_way, reuse)
    by_id = {pending.row.pk: pending for pending in rows}
    if runs and executions.isEnabledFor(logging.INFO):  # off by default: no join per chunk
        first = by_id[runs[0].key].row
        executions.info("executed batch=%s engine=%s lines=%s at=%.6f", first.batch_id, first.claimed_by,
                        ",".join(str(by_id[run.key].row.line) for run in runs), time.time())
    return [_result(by_id[run.key], endpoint, run.outcome, run.packed) for run in runs]


def _result(pending, endpoint, outcome, packed):
    row, request_id = pending.row, new_id("req_")
    if isinstance(outcome, ApiError):
        if pending.asked is not None:
            outcome = renamed(outcome, "body.")
        body = outcome.management_body() if endpoint == PROBE_SCORE else outcome.body()
        failure = {"status": outcome.status, "code": outcome.code, "message": f"Line {row.line}: {outcome.message}"}
        return RowResult(row, BatchRow.Outcome.FAILED, body, failure, request_id, packed, headers=None, usage={})
    if pending.asked is not None:  # a /v1/responses row: its chat answer, as a response object
        answer, kept = row_answer(pending.asked, outcome.body)
        return RowResult(row, BatchRow.Outcome.SUCCEEDED, answer, None, request_id, packed,
                         headers=outcome.headers, usage=row_usage(answer), kept=kept)
    usage = outcome.body.get("usage") or {}
    return RowResult(row, BatchRow.Outcome.SUCCEEDED, outcome.body, None, request_id, packed,
                     headers=outcome.headers, usage=usage)
