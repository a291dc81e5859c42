"""Validation of a batch's input file (SPEC 10), in the engine, off the admission slot.

The file streams line by line (memory independent of its size) and nothing is tokenised. Each
line gets the synchronous route's own schema and refusals, in strict mode, through
`inference_app.schemas.parse_request`, and its model is resolved by `catalogue.resolve`, so a
line is refused with exactly the code and message the route would give.
"""

import json
import logging
from collections import Counter

from django.conf import settings

from batches_app import leasing
from batches_app.models import Batch
from files_app.models import file_storage
from inference_app.catalogue import resolve
from millm_lib.errors import ApiError
from inference_app.models import Engine
from millm_lib.jsonbody import plainly_usable, unusable_text
from inference_app.schemas import parse_request
from inference_app.structured import grammar_kind
from inference_app.tools import decoding_format
from millm_lib.limits import PROBE_SCORE, RESPONSES
from responses_app.requests import renamed
from responses_app.rows import check_row, engine_request

log = logging.getLogger("millm.batches")

INSERT_EVERY = 1000
FIRST_ERRORS = 100


class LineError(Exception):
    def __init__(self, code, message, param=None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def read_lines(storage_name):
    """The file's lines without their newline; an empty piece after the last newline is none."""
    with file_storage().open(storage_name, "rb") as handle:
        for raw in handle:
            yield raw[:-1] if raw.endswith(b"\n") else raw


class LineChecker:
    """The line checks of SPEC 10, in order. Remembers valid custom_ids and resolved models."""

    def __init__(self, endpoint, check_grammar=None):
        """`check_grammar(response_format, param)`: the engine's compile of a row's grammar
        (raises the ApiError of a schema it cannot enforce), or None where no model is resident."""
        self.endpoint = endpoint
        self.check_grammar = check_grammar
        self.seen = set()
        self.resolved = {}

    def check(self, raw, number):
        """Returns (custom_id, body, model id) of a valid line, or raises LineError."""
        if len(raw) > settings.BATCH_MAX_LINE_BYTES:
            raise LineError("line_too_large", f"the line is {len(raw):,} bytes, over {settings.BATCH_MAX_LINE_BYTES:,} (BATCH_MAX_LINE_BYTES)")
        if not raw.strip():
            raise LineError("invalid_json", "the line is blank")
        try:
            text = raw.decode("utf-8")
            line = _DECODER.decode(text)
        except UnicodeDecodeError as error:
            raise LineError("invalid_json", f"the line is not valid UTF-8 ({error.reason} at byte {error.start})") from None
        except (ValueError, RecursionError) as error:
            raise LineError("invalid_json", f"the line is not valid JSON: {error}") from None
        unusable = None if plainly_usable(text) else unusable_text(line)
        if unusable is not None:
            # PostgreSQL cannot store U+0000, UTF-8 cannot encode a lone surrogate: as the routes refuse them.
            raise LineError("invalid_json", f"the line is not usable JSON: '{unusable[0] or 'line'}' {unusable[1]}",
                            unusable[0] or None)
        if not isinstance(line, dict):
            raise LineError("invalid_line", "the line must be a JSON object with custom_id, method, url and body")
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
            raise LineError("invalid_custom_id", "custom_id must be a non-empty string of at most 512 characters", "custom_id")
        if custom_id in self.seen:
            raise LineError("duplicate_custom_id", f"custom_id '{custom_id}' is already used by an earlier line", "custom_id")
        if line.get("method") != "POST":
            raise LineError("invalid_method", f"method must be POST, got {json.dumps(line.get('method'))}", "method")
        if line.get("url") != self.endpoint:
            raise LineError("invalid_url", f"url must be the batch's endpoint {self.endpoint}, got {json.dumps(line.get('url'))}", "url")
        body = line.get("body")
        if not isinstance(body, dict):
            raise LineError("invalid_body", "body must be a JSON object", "body")
        if body.get("stream") is True:
            raise LineError("stream_not_supported", "batch lines cannot stream: remove stream: true", "body.stream")
        unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
        if unknown:
            raise LineError("invalid_line", f"unknown field(s) in the line: {', '.join(unknown)}", unknown[0])
        try:
            parsed = parse_request(self.endpoint, body, strict=True, param_prefix="body.")
            check_row(parsed)
            decoded, field = decoding_format(engine_request(parsed).request)
            if self.check_grammar is not None and grammar_kind(decoded) is not None:
                self.check_grammar(decoded, f"body.{field}")
        except ApiError as error:
            if self.endpoint == RESPONSES:
                error = renamed(error)  # a grammar refused as the chat request's: named as this body's field
            raise LineError(error.code, error.message, error.param) from None
        model = None
        if self.endpoint != PROBE_SCORE:
            model = self._resolve(parsed.request.model)
        self.seen.add(custom_id)
        return custom_id, body, model

    def _resolve(self, name):
        if name not in self.resolved:
            try:
                self.resolved[name] = resolve(name).id
            except ApiError as error:
                self.resolved[name] = error
        outcome = self.resolved[name]
        if isinstance(outcome, ApiError):
            raise LineError(outcome.code, outcome.message, "body.model")
        return outcome


def _refuse_constant(name):
    raise ValueError(f"{name} is not allowed in JSON")


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)  # made once: json.loads makes one a line


def validate(batch, resident_model_id, check_grammar=None):
    """Validate every line, store the rows, and decide the batch's fate.

    1. Stream the file; each line becomes a pending row or an invalid one (with its error).
    2. Fail the batch (no row run, no lease taken) when no line is valid, the valid lines name
       more than one model, the model is not resident on a live engine, or an outside holder
       leases it.
    3. Otherwise it is in_progress and waits its turn (`queued`).
    Returns the new status, or None when the batch was cancelled or fenced meanwhile.
    """
    batch.discard_rows()
    try:
        return _validate_lines(batch, resident_model_id, check_grammar)
    except OSError as error:
        # The input's bytes are gone (deleted or lost under us): fail, do not retry forever.
        log.error("cannot read the input file of %s: %s", batch.pk, error)
        failure = {"code": "input_file_unreadable", "line": None, "param": None,
                   "message": f"The input file {batch.input_file_id} could not be read: {error}"}
        return Batch.Status.FAILED if batch.fail_validation(errors=[failure]) else None


def _validate_lines(batch, resident_model_id, check_grammar=None):
    checker = LineChecker(batch.endpoint, check_grammar)
    pending, models, errors = [], Counter(), []
    total = invalid = 0
    log.info("validating %s: streaming %s (%d lines)", batch.pk, batch.input_file_id, batch.input_file.line_count)
    for number, raw in enumerate(read_lines(batch.input_file.storage_name), start=1):
        total = number
        if number % 10_000 == 0:
            log.info("validating %s: %d lines read, %d invalid so far", batch.pk, number, invalid)
        try:
            custom_id, body, model = checker.check(raw, number)
            pending.append((number, custom_id, body, None))
            models[model] += 1
        except LineError as error:
            invalid += 1
            message = f"Line {number}: {error.message}"
            custom_id = _custom_id_of(raw)
            pending.append((number, custom_id, None, {"code": error.code, "message": message}))
            if len(errors) < FIRST_ERRORS:
                errors.append({"code": error.code, "line": number, "message": message, "param": error.param})
        if len(pending) >= INSERT_EVERY:
            if not batch.insert_rows(pending):
                return None  # cancelled, or another engine took it over
            pending = []
    if not batch.insert_rows(pending):
        return None
    valid = total - invalid
    log.info("validated %s: %d lines, %d valid, %d invalid", batch.pk, total, valid, invalid)

    model = _single_model(models)
    failure = _batch_failure(batch, valid, models, model, resident_model_id)
    fields = {"total": total, "failed": invalid, "errors": errors or None}
    if failure is not None:
        fields["errors"] = [failure] + (errors[: FIRST_ERRORS - 1])
        return Batch.Status.FAILED if batch.fail_validation(model=model, **fields) else None
    if batch.endpoint == PROBE_SCORE:
        model = resident_model_id
    return Batch.Status.IN_PROGRESS if batch.queue_to_run(model=model, **fields) else None


def _single_model(models):
    named = [model for model in models if model is not None]
    return named[0] if len(named) == 1 else None


def _batch_failure(batch, valid, models, model, resident_model_id):
    def failure(code, message):
        return {"code": code, "line": None, "message": message, "param": None}

    if valid == 0:
        return failure("empty_file", "No line of the input file is valid; the error file lists why")
    named = {name: count for name, count in models.items() if name is not None}
    if len(named) > 1:
        listed = ", ".join(f"'{name}' ({count} lines)" for name, count in sorted(named.items()))
        return failure("multiple_models", f"The valid lines name more than one model: {listed}; a batch runs one model")
    target = model if batch.endpoint != PROBE_SCORE else resident_model_id
    if target is None or Engine.objects.serving(target) is None:
        resident = ", ".join(
            f"'{model_id}'"
            for model_id in Engine.objects.live().active().exclude(resident_model_id=None).values_list("resident_model_id", flat=True)
        )
        return failure(
            "model_not_resident",
            f"The model '{target}' is not resident on a live engine (resident: {resident or 'none'}); "
            "a batch never loads a model: load it first",
        )
    lease = leasing.blocking_lease(batch, target)
    if lease is not None:
        return failure("model_leased", f"The model '{target}' is leased: {lease.describe()}")
    return None


def _custom_id_of(raw):
    try:
        line = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    custom_id = line.get("custom_id") if isinstance(line, dict) else None
    usable = isinstance(custom_id, str) and unusable_text(custom_id) is None
    return custom_id if usable and len(custom_id) <= 512 else None
