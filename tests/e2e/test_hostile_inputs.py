"""Hostile input on every route (issue 10, part 5): malformed and truncated JSON, wrong types,
NaN and huge numbers, deep nesting, control characters, U+0000 and lone surrogates, a 50 MB body
(declared and chunked), multipart without a file, a filename with `../`, ids that are SQL or
paths, JSONL lines of exactly the limit and one byte over, a file of only blank lines.

Each refusal is its documented 4xx in the route's envelope, naming the field and the limit, never
a 500; nothing is stored after a refusal; the server keeps serving. The stack is this module's
own, with small upload limits, so that the limits cost a few bytes and the row counts are ours.
"""

import json
import re
import select
import socket
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.batch_helpers import FINISHED, line, to_jsonl
from tests.e2e.conftest import MODEL_ID
from tests.e2e.stack import Stack, wait_until
from tests.e2e.test_upload_memory import peak_rss_mb

MAX_LINE = 256
MAX_ROWS = 8
MAX_FILE = 2048  # 8 lines of MAX_LINE bytes are over it: each limit is crossed alone
LIMITS = {"BATCH_MAX_LINE_BYTES": MAX_LINE, "BATCH_MAX_ROWS": MAX_ROWS, "BATCH_MAX_FILE_BYTES": MAX_FILE}
FIFTY_MB = 50 * 1024 * 1024

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
RESPONSES = "/v1/responses"
FILES, BATCHES = "/v1/files", "/v1/batches"
MODEL = f"/api/models/{MODEL_ID}"
USER = [{"role": "user", "content": "hi"}]
FILE_ID = "FILE_ID"  # replaced by the id of a real batch input file uploaded before the corpus
ANY = object()  # the case does not pin the param
STORED_TABLES = ["files_app_file", "files_app_idempotencykey", "batches_app_batch", "batches_app_batchrow",
                 "inference_app_probe", "inference_app_modelentry", "inference_app_lease",
                 "responses_app_storedresponse"]


def chat(**fields):
    return json.dumps({"model": MODEL_ID, "messages": USER, "max_tokens": 2, **fields})


def completion(**fields):
    return json.dumps({"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, **fields})


def embedding(**fields):
    return json.dumps({"model": MODEL_ID, "input": "hi", **fields})


def respond(**fields):
    return json.dumps({"model": MODEL_ID, "input": "hi", "max_output_tokens": 2, **fields})


def batch(**fields):
    return json.dumps({"input_file_id": FILE_ID, "endpoint": COMPLETIONS, "completion_window": "24h", **fields})


def probe(**fields):
    return json.dumps({"name": "p", "model": MODEL_ID, "layer": 1, "weights": [0.1] * 64, "aggregation": "mean", **fields})


def score(**fields):
    return json.dumps({"inputs": [{"text": "hi"}], **fields})


def jsonl_lines(*lengths):
    """JSONL whose lines are exactly these byte lengths (the newline not counted)."""
    return b"".join(b'{"p":"' + b"x" * (length - 8) + b'"}\n' for length in lengths)


def multipart(*parts, boundary="bnd"):
    """A multipart body by hand: parts are (name, filename or None, bytes)."""
    body = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return body + f"--{boundary}--\r\n".encode()


MULTIPART = "multipart/form-data; boundary=bnd"
PURPOSE = ("purpose", None, b"batch")


@dataclass
class Case:
    name: str
    method: str
    path: str
    status: int
    code: str
    param: object = ANY
    says: tuple = ()
    body: object = None  # str or bytes
    content_type: str = "application/json"
    headers: dict = field(default_factory=dict)


def C(name, method, path, body, status, code, param=ANY, *says, content_type="application/json", headers=None):
    return Case(name, method, path, status, code, param, says, body, content_type, headers or {})


CORPUS = [
    # --- /v1/chat/completions ---
    C("chat: truncated JSON", "POST", CHAT, '{"model": "tiny-llama", "messages": [{"role": "user", "content": "hel',
      400, "invalid_json", None, "not valid JSON"),
    C("chat: empty body", "POST", CHAT, "", 400, "invalid_json", None, "not valid JSON"),
    C("chat: a raw control byte in a string", "POST", CHAT, chat().replace("hi", "h\x07i").encode(),
      400, "invalid_json", None, "control character"),
    C("chat: U+0000 in the content", "POST", CHAT, chat(messages=[{"role": "user", "content": "a\u0000b"}]),
      400, "invalid_json", "messages.0.content", "U+0000"),
    C("chat: a lone surrogate in the content", "POST", CHAT, chat().replace('"hi"', '"\\ud800"'),
      400, "invalid_json", "messages.0.content", "surrogate"),
    C("chat: a lone surrogate in a key", "POST", CHAT, chat().replace('"role"', '"r\\udc00"', 1),
      400, "invalid_json", "messages.0", "surrogate"),
    C("chat: Infinity", "POST", CHAT, chat().replace('"max_tokens": 2', '"temperature": Infinity'),
      400, "invalid_json", None, "Infinity"),
    C("chat: -Infinity", "POST", CHAT, chat().replace('"max_tokens": 2', '"top_p": -Infinity'),
      400, "invalid_json", None, "-Infinity"),
    C("chat: messages a string", "POST", CHAT, chat(messages="hello"), 400, "invalid_parameter", "messages"),
    C("chat: messages null", "POST", CHAT, chat(messages=None), 400, "invalid_parameter", "messages", "required"),
    C("chat: a message without a role", "POST", CHAT, chat(messages=[{"content": "x"}]),
      400, "invalid_parameter", "messages.0.role", "required"),
    C("chat: a text part that is a number", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
      400, "invalid_parameter", "messages.0.content.0.text"),
    C("chat: 900 levels of nesting in messages", "POST", CHAT, chat().replace(json.dumps(USER), "[" * 900 + "]" * 900),
      400, "invalid_json", ANY, "nested more than 64 levels"),
    C("chat: 60 levels of nesting in messages", "POST", CHAT, chat().replace(json.dumps(USER), "[" * 60 + "]" * 60),
      400, "invalid_parameter", "messages.0"),
    C("chat: max_tokens a float", "POST", CHAT, chat(max_tokens=2.5), 400, "invalid_parameter", "max_tokens"),
    C("chat: max_tokens negative", "POST", CHAT, chat(max_tokens=-1), 400, "invalid_parameter", "max_tokens"),
    C("chat: max_tokens 1e308", "POST", CHAT, chat(max_tokens=1e308), 400, "invalid_parameter", "max_tokens"),
    C("chat: temperature a string", "POST", CHAT, chat(temperature="hot"), 400, "invalid_parameter", "temperature"),
    C("chat: top_p 1e308", "POST", CHAT, chat(top_p=1e308), 400, "invalid_parameter", "top_p", "less than or equal to 1"),
    C("chat: an empty stop", "POST", CHAT, chat(stop=[""]), 400, "invalid_parameter", "stop.0"),
    C("chat: seed a float", "POST", CHAT, chat(seed=1.5), 400, "invalid_parameter", "seed"),
    C("chat: seed 10^30", "POST", CHAT, chat(seed=10**30), 400, "invalid_parameter", "seed", "4294967295"),
    C("chat: stream a string", "POST", CHAT, chat(stream="yes"), 400, "invalid_parameter", "stream"),
    C("chat: include_usage a string", "POST", CHAT, chat(stream_options={"include_usage": "yes"}),
      400, "invalid_parameter", "stream_options.include_usage"),
    C("chat: logit_bias of 301 tokens", "POST", CHAT, chat(logit_bias={str(i): 1 for i in range(301)}),
      400, "invalid_parameter", "logit_bias", "at most 300"),
    C("chat: logit_bias 1e308", "POST", CHAT, chat(logit_bias={"1": 1e308}), 400, "invalid_parameter", "logit_bias.1", "100"),
    C("chat: logit_bias a word for a token", "POST", CHAT, chat(logit_bias={"hello": 5}), 400, "invalid_parameter",
      "logit_bias.hello"),
    C("chat: logit_bias a token of 10^9", "POST", CHAT, chat(logit_bias={"999999999": 5}), 400, "invalid_parameter",
      "logit_bias", "outside the vocabulary"),
    C("chat: presence_penalty 1e308", "POST", CHAT, chat(presence_penalty=1e308), 400, "invalid_parameter",
      "presence_penalty", "less than or equal to 2"),
    C("chat: n 9", "POST", CHAT, chat(n=9), 400, "invalid_parameter", "n", "less than or equal to 8"),
    C("chat: n 10^9", "POST", CHAT, chat(n=10**9), 400, "invalid_parameter", "n"),
    C("chat: 129 tools", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]),
      400, "invalid_request_error", "tools", "over the limit of 128"),
    C("chat: a tool's parameters outside the subset", "POST", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "patternProperties": {}}}}], tool_choice="required"),
      400, "invalid_request_error", "tools.0.function.parameters.patternProperties"),
    C("chat: a tool message without its call id", "POST", CHAT,
      chat(messages=[{"role": "tool", "content": "18"}]), 400, "invalid_request_error", "messages.0.tool_call_id"),
    C("chat: a negative allowed token", "POST", CHAT, chat(allowed_token_ids=[-1], max_tokens=1),
      400, "invalid_parameter", "allowed_token_ids.0"),
    C("chat: 1,025 allowed tokens", "POST", CHAT, chat(allowed_token_ids=list(range(1025)), max_tokens=1),
      400, "invalid_parameter", "allowed_token_ids", "1024"),
    C("chat: an allowed token of 10^30", "POST", CHAT, chat(allowed_token_ids=[10**30], max_tokens=1),
      400, "invalid_scoring_request", "allowed_token_ids", "1000000000000000000000000000000", "vocabulary"),
    C("chat: strict mode and an unknown field", "POST", CHAT, chat(colour="blue"), 400, "unused_fields_refused", "colour",
      "colour", headers={"X-miLLM-Strict": "true"}),
    C("chat: a bad load policy header", "POST", CHAT, chat(), 400, "invalid_parameter", "X-miLLM-Load-Policy",
      "sometimes", headers={"X-miLLM-Load-Policy": "sometimes"}),
    C("chat: a model that is SQL", "POST", CHAT, chat(model="tiny-llama' OR '1'='1"), 404, "model_not_found", "model"),
    C("chat: a model that is a path", "POST", CHAT, chat(model="../../../etc/passwd"), 404, "model_not_found", "model"),
    C("chat: a text/plain body", "POST", CHAT, chat(), 415, "unsupported_media_type", None, "application/json",
      content_type="text/plain"),
    # --- /v1/completions ---
    C("completions: truncated JSON", "POST", COMPLETIONS, '{"model": "tiny-llama", "prompt": ["a", ',
      400, "invalid_json", None),
    C("completions: a prompt of token arrays", "POST", COMPLETIONS, completion(prompt=[[1, 2]]), 400, "invalid_parameter", "prompt.0"),
    C("completions: logprobs 21", "POST", COMPLETIONS, completion(logprobs=21, max_tokens=1), 400, "invalid_parameter", "logprobs", "20"),
    C("completions: logprobs a boolean", "POST", COMPLETIONS, completion(logprobs=True, max_tokens=1), 400, "invalid_parameter", "logprobs"),
    C("completions: a stream of two prompts", "POST", COMPLETIONS, completion(prompt=["a", "b"], stream=True),
      400, "invalid_parameter", "prompt", "one prompt, got 2"),
    C("completions: suffix", "POST", COMPLETIONS, completion(suffix="end"), 400, "field_not_honoured", "suffix"),
    C("completions: best_of 3", "POST", COMPLETIONS, completion(best_of=3), 400, "field_not_honoured", "best_of"),
    C("completions: a prompt over the context", "POST", COMPLETIONS, completion(prompt="hello " * 2000),
      400, "context_length_exceeded", ANY, "1024"),
    # --- /v1/embeddings ---
    C("embeddings: 129 inputs", "POST", EMBEDDINGS, embedding(input=["x"] * 129), 400, "invalid_parameter", "input",
      "129", "128", "EMBEDDINGS_MAX_INPUTS"),
    C("embeddings: an empty input in a list", "POST", EMBEDDINGS, embedding(input=["a", ""]), 400, "invalid_parameter", "input.1"),
    C("embeddings: token ids as input", "POST", EMBEDDINGS, embedding(input=[1, 2, 3]), 400, "invalid_parameter", "input.0"),
    C("embeddings: encoding_format hex", "POST", EMBEDDINGS, embedding(encoding_format="hex"), 400, "invalid_parameter", "encoding_format"),
    C("embeddings: dimensions", "POST", EMBEDDINGS, embedding(dimensions=8), 400, "field_not_honoured", "dimensions"),
    C("embeddings: normalize a string", "POST", EMBEDDINGS, embedding(normalize="yes"), 400, "invalid_parameter", "normalize"),
    C("embeddings: an input over the context", "POST", EMBEDDINGS, embedding(input=["ok", "hello " * 2000]),
      400, "context_length_exceeded", "input[1]", "1024"),
    C("embeddings: a lone surrogate", "POST", EMBEDDINGS, embedding().replace('"hi"', '"\\udfff"'),
      400, "invalid_json", "input", "surrogate"),
    # --- /v1/models/{id} ---
    C("model: an id that is SQL", "GET", "/v1/models/x' OR 1=1 --", None, 404, "model_not_found", "model"),
    C("model: an id that is a path", "GET", "/v1/models/..%2F..%2Fetc%2Fpasswd", None, 404, "model_not_found", "model",
      "../../etc/passwd"),
    C("model: a NUL in the id", "GET", "/v1/models/tiny%00llama", None, 400, "invalid_parameter", "path", "NUL"),
    C("model: DELETE", "DELETE", f"/v1/models/{MODEL_ID}", None, 405, "method_not_allowed", None, "GET"),
    # --- /v1/responses ---
    C("responses: truncated JSON", "POST", RESPONSES, '{"model": "tiny-llama", "input": "hel', 400, "invalid_json", None,
      "not valid JSON"),
    C("responses: U+0000 in the input", "POST", RESPONSES, respond(input="a\u0000b"), 400, "invalid_json", "input", "U+0000"),
    C("responses: a lone surrogate in an item", "POST", RESPONSES,
      respond(input=[{"role": "user", "content": "hi"}]).replace('"hi"', '"\\ud800"'), 400, "invalid_json",
      "input.0.content", "surrogate"),
    C("responses: input a number", "POST", RESPONSES, respond(input=5), 400, "invalid_parameter", "input"),
    C("responses: an item without a role", "POST", RESPONSES, respond(input=[{"content": "x"}]), 400, "invalid_parameter",
      ANY),
    C("responses: a text part that is a number", "POST", RESPONSES,
      respond(input=[{"role": "user", "content": [{"type": "input_text", "text": 5}]}]), 400, "invalid_parameter",
      "input.0.content.0.text"),
    C("responses: 900 levels of nesting in input", "POST", RESPONSES, respond(input=[]).replace("[]", "[" * 900 + "]" * 900),
      400, "invalid_json", ANY, "nested more than 64 levels"),
    C("responses: max_output_tokens 1e308", "POST", RESPONSES, respond(max_output_tokens=1e308), 400, "invalid_parameter",
      "max_output_tokens"),
    C("responses: an audio part", "POST", RESPONSES,
      respond(input=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}]),
      400, "field_not_honoured", "input.0.content.0.type", "text only"),
    C("responses: a file search tool", "POST", RESPONSES, respond(tools=[{"type": "file_search"}]), 400,
      "field_not_honoured", "tools.0.type", "file_search"),
    C("responses: metadata of 17 keys", "POST", RESPONSES, respond(metadata={f"k{i}": "v" for i in range(17)}), 400,
      "invalid_parameter", "metadata"),
    C("responses: an unknown previous_response_id", "POST", RESPONSES,
      respond(previous_response_id="resp_' OR 1=1 --"), 404, "response_not_found", "previous_response_id"),
    C("responses: an id that is SQL", "GET", RESPONSES + "/resp_' OR 1=1 --", None, 404, "response_not_found",
      "response_id"),
    C("responses: DELETE an unknown id", "DELETE", RESPONSES + "/resp_" + "0" * 24, None, 404, "response_not_found",
      "response_id"),
    C("responses: PUT", "PUT", RESPONSES + "/resp_" + "0" * 24, None, 405, "method_not_allowed", None, "GET"),
    C("responses: input items of an unknown id", "GET", RESPONSES + "/resp_x/input_items", None, 404,
      "response_not_found", "response_id"),
    # --- /v1/files ---
    C("files: multipart without a file", "POST", FILES, multipart(PURPOSE), 400, "invalid_batch_request", "file",
      "'file'", content_type=MULTIPART),
    C("files: multipart without a boundary", "POST", FILES, b"garbage", 400, "invalid_batch_request", "file",
      "boundary", content_type="multipart/form-data"),
    C("files: a JSON body", "POST", FILES, '{"purpose": "batch"}', 415, "unsupported_media_type", None, "multipart/form-data"),
    C("files: purpose fine-tune", "POST", FILES, multipart(("purpose", None, b"fine-tune"), ("file", "a.jsonl", b"{}\n")),
      400, "invalid_batch_request", "purpose", "fine-tune", content_type=MULTIPART),
    C("files: the file in a part named data", "POST", FILES, multipart(PURPOSE, ("data", "a.jsonl", b"{}\n")),
      400, "invalid_batch_request", "file", "'data'", content_type=MULTIPART),
    C("files: two files", "POST", FILES, multipart(PURPOSE, ("file", "a.jsonl", b"{}\n"), ("file", "b.jsonl", b"{}\n")),
      400, "invalid_batch_request", "file", "exactly one file", content_type=MULTIPART),
    C("files: expires_after seconds 1e999", "POST", FILES, multipart(
        PURPOSE, ("expires_after[anchor]", None, b"created_at"), ("expires_after[seconds]", None, b"1e999"),
        ("file", "a.jsonl", b"{}\n")), 400, "invalid_batch_request", "expires_after[seconds]", "3,600", "2,592,000",
      content_type=MULTIPART),
    C("files: expires_after anchor", "POST", FILES, multipart(
        PURPOSE, ("expires_after[anchor]", None, b"last_active_at"), ("expires_after[seconds]", None, b"3600"),
        ("file", "a.jsonl", b"{}\n")), 400, "invalid_batch_request", "expires_after[anchor]", content_type=MULTIPART),
    C("files: a line one byte over the limit", "POST", FILES, multipart(PURPOSE, ("file", "a.jsonl", jsonl_lines(10, MAX_LINE + 1))),
      400, "batch_file_limit", "file", "line 2", f"{MAX_LINE + 1:,} bytes", f"limit {MAX_LINE:,}", "BATCH_MAX_LINE_BYTES",
      content_type=MULTIPART),
    C("files: a last line without newline one byte over", "POST", FILES,
      multipart(PURPOSE, ("file", "a.jsonl", jsonl_lines(MAX_LINE + 1)[:-1])),
      400, "batch_file_limit", "file", "BATCH_MAX_LINE_BYTES", content_type=MULTIPART),
    C("files: one row over the limit", "POST", FILES, multipart(PURPOSE, ("file", "a.jsonl", b"{}\n" * (MAX_ROWS + 1))),
      400, "batch_file_limit", "file", f"{MAX_ROWS + 1:,} lines", f"limit {MAX_ROWS:,}", "BATCH_MAX_ROWS", content_type=MULTIPART),
    C("files: over the byte limit", "POST", FILES, multipart(PURPOSE, ("file", "a.jsonl", jsonl_lines(*[MAX_LINE] * MAX_ROWS))),
      400, "batch_file_limit", "file", f"limit {MAX_FILE:,}", "BATCH_MAX_FILE_BYTES", content_type=MULTIPART),
    C("files: an Idempotency-Key of 256 characters", "POST", FILES, multipart(PURPOSE, ("file", "a.jsonl", b"{}\n")),
      400, "invalid_parameter", "Idempotency-Key", "255", "256", content_type=MULTIPART, headers={"Idempotency-Key": "k" * 256}),
    C("files: limit 0", "GET", FILES + "?limit=0", None, 400, "invalid_parameter", "limit", "1 to 10000"),
    C("files: limit 10^30", "GET", FILES + "?limit=" + "9" * 30, None, 400, "invalid_parameter", "limit"),
    C("files: order sideways", "GET", FILES + "?order=sideways", None, 400, "invalid_parameter", "order", "asc, desc"),
    C("files: a NUL in after", "GET", FILES + "?after=file-%00", None, 400, "invalid_parameter", "after", "NUL"),
    C("files: an id that is SQL", "GET", FILES + "/file-' OR '1'='1", None, 404, "file_not_found", "file_id"),
    C("files: content of an id that is a path", "GET", FILES + "/..%2F..%2Fetc%2Fpasswd/content", None, 404, "not_found", None),
    C("files: content of a NUL id", "GET", FILES + "/file-%00/content", None, 400, "invalid_parameter", "path"),
    C("files: DELETE an unknown id", "DELETE", FILES + "/file-" + "0" * 24, None, 404, "file_not_found", "file_id"),
    C("files: PATCH a file", "PATCH", FILES + "/" + FILE_ID, None, 405, "method_not_allowed", None),
    # --- /v1/batches ---
    C("batches: 100,000 levels of nesting", "POST", BATCHES, "[" * 100_000 + "]" * 100_000, 400, "invalid_json", None, "nested"),
    C("batches: NaN", "POST", BATCHES, batch().replace('"24h"', "NaN"), 400, "invalid_json", None, "NaN"),
    C("batches: invalid UTF-8", "POST", BATCHES, batch().encode().replace(b"24h", b"\xff\xfe"), 400, "invalid_json", None, "UTF-8"),
    C("batches: U+0000 in input_file_id", "POST", BATCHES, batch(input_file_id="file-\u0000"), 400, "invalid_json", "input_file_id", "U+0000"),
    C("batches: input_file_id a number", "POST", BATCHES, batch(input_file_id=5), 400, "invalid_batch_request", "input_file_id", "got 5"),
    C("batches: input_file_id 1e999", "POST", BATCHES, batch().replace(f'"{FILE_ID}"', "1e999"), 400, "invalid_batch_request",
      "input_file_id", "Infinity"),
    C("batches: input_file_id a path", "POST", BATCHES, batch(input_file_id="../../../etc/passwd"), 404, "file_not_found", "input_file_id"),
    C("batches: input_file_id SQL", "POST", BATCHES, batch(input_file_id="x'; DROP TABLE files_app_file; --"), 404,
      "file_not_found", "input_file_id"),
    C("batches: endpoint moderations", "POST", BATCHES, batch(endpoint="/v1/moderations"), 400, "invalid_batch_request", "endpoint",
      "/v1/moderations"),
    C("batches: completion_window in words", "POST", BATCHES, batch(completion_window="24 hours"), 400, "invalid_batch_request",
      "completion_window", "168h"),
    C("batches: completion_window of 10^6 hours", "POST", BATCHES, batch(completion_window="1000000h"), 400,
      "invalid_batch_request", "completion_window"),
    C("batches: 17 metadata pairs", "POST", BATCHES, batch(metadata={f"k{i}": "v" for i in range(17)}), 400,
      "invalid_batch_request", "metadata", "16"),
    C("batches: a metadata value that is a number", "POST", BATCHES, batch(metadata={"k": 1}), 400, "invalid_batch_request", "metadata"),
    C("batches: output expiry of 10 seconds", "POST", BATCHES, batch(output_expires_after={"anchor": "created_at", "seconds": 10}),
      400, "invalid_batch_request", "output_expires_after.seconds", "3,600"),
    C("batches: pack a string", "POST", BATCHES, batch(pack="yes"), 400, "invalid_batch_request", "pack"),
    C("batches: pack_window 10^30", "POST", BATCHES, batch(pack_window=10**30), 400, "invalid_batch_request", "pack_window",
      "BATCH_PACK_WINDOW_MAX"),
    C("batches: an unknown field", "POST", BATCHES, batch(priority="high"), 400, "invalid_batch_request", "priority"),
    C("batches: a malformed lease header", "POST", BATCHES, batch(), 400, "invalid_lease_request", "X-miLLM-Lease",
      headers={"X-miLLM-Lease": "lease_' OR 1=1 --"}),
    C("batches: an unknown lease", "POST", BATCHES, batch(), 404, "lease_not_found", "X-miLLM-Lease",
      headers={"X-miLLM-Lease": "lease_" + "0" * 40}),
    C("batches: an Idempotency-Key of 300 characters", "POST", BATCHES, batch(), 400, "invalid_parameter", "Idempotency-Key",
      headers={"Idempotency-Key": "k" * 300}),
    C("batches: a text/plain body", "POST", BATCHES, batch(), 415, "unsupported_media_type", None, content_type="text/plain"),
    C("batches: limit 101", "GET", BATCHES + "?limit=101", None, 400, "invalid_parameter", "limit", "1 to 100"),
    C("batches: an id that is SQL", "GET", BATCHES + "/batch_' OR 1=1", None, 404, "batch_not_found", "batch_id"),
    C("batches: cancel an unknown batch", "POST", BATCHES + "/batch_" + "f" * 24 + "/cancel", None, 404, "batch_not_found", "batch_id"),
    C("batches: hand a lease to an unknown batch", "POST", BATCHES + "/batch_" + "f" * 24 + "/lease", None, 404,
      "batch_not_found", "batch_id", headers={"X-miLLM-Lease": "lease_" + "0" * 40}),
    C("batches: a NUL in the id", "GET", BATCHES + "/batch_%00", None, 400, "invalid_parameter", "path"),
    # --- /api/models, load, unload ---
    C("register: U+0000 in the source", "POST", "/api/models", json.dumps({"source": "/tmp/\u0000x"}), 400, "invalid_json", "source"),
    C("register: a source too long for the filesystem", "POST", "/api/models", json.dumps({"source": "/tmp/" + "a/" * 3000 + "m.gguf"}),
      400, "invalid_model_request", "source", "too long"),
    C("register: a source that is /etc/passwd", "POST", "/api/models", json.dumps({"source": "/etc/passwd"}), 400,
      "invalid_model_request", "source", "/etc/passwd"),
    C("register: an id of 1,000 characters", "POST", "/api/models", json.dumps({"source": "/tmp", "id": "m" * 1000}), 400,
      "invalid_model_request", "id", "255"),
    C("register: source a number", "POST", "/api/models", json.dumps({"source": 5}), 400, "invalid_model_request", "source"),
    C("register: an unknown field", "POST", "/api/models", json.dumps({"source": "/tmp", "sudo": True}), 400,
      "invalid_model_request", "sudo", "unknown field"),
    C("register: an array body", "POST", "/api/models", "[1, 2]", 400, "invalid_model_request", None, "JSON object"),
    C("register: PATCH", "PATCH", "/api/models", None, 405, "method_not_allowed", ANY, "GET, POST"),
    C("load: an unknown model", "POST", "/api/models/nope/load", None, 404, "model_not_found", ANY, "nope"),
    C("load: engine a number", "POST", MODEL + "/load", json.dumps({"engine": 5}), 400, "invalid_load_request", "engine"),
    C("load: an engine id that is SQL", "POST", MODEL + "/load", json.dumps({"engine": "eng_' OR 1=1"}), 404,
      "engine_not_found", "engine"),
    C("unload: a model id that is a path", "POST", "/api/models/..%2F..%2Fetc/unload", None, 404, "model_not_found", ANY),
    C("register: a NUL in a model id", "GET", "/api/models/tiny%00llama", None, 400, "invalid_parameter", "path", "NUL"),
    # --- leases ---
    C("lease: an empty holder", "POST", MODEL + "/lease", json.dumps({"holder": "", "reason": "r"}), 400,
      "invalid_lease_request", "holder"),
    C("lease: ttl 1e999", "POST", MODEL + "/lease", '{"holder": "h", "reason": "r", "ttl_seconds": 1e999}', 400,
      "invalid_lease_request", "ttl_seconds"),
    C("lease: ttl 10^30", "POST", MODEL + "/lease", json.dumps({"holder": "h", "reason": "r", "ttl_seconds": 10**30}), 400,
      "invalid_lease_request", "ttl_seconds", "7200"),
    C("lease: ttl a boolean", "POST", MODEL + "/lease", json.dumps({"holder": "h", "reason": "r", "ttl_seconds": True}), 400,
      "invalid_lease_request", "ttl_seconds"),
    C("lease: a reason of 600 characters", "POST", MODEL + "/lease", json.dumps({"holder": "h", "reason": "r" * 600}), 400,
      "invalid_lease_request", "reason", "512"),
    C("lease: U+0000 in the holder", "POST", MODEL + "/lease", json.dumps({"holder": "h\u0000", "reason": "r"}), 400,
      "invalid_json", "holder"),
    C("lease: renew without the header", "POST", MODEL + "/lease/renew", None, 400, "invalid_lease_request", "X-miLLM-Lease"),
    C("lease: renew with SQL", "POST", MODEL + "/lease/renew", None, 400, "invalid_lease_request", "X-miLLM-Lease",
      headers={"X-miLLM-Lease": "lease_' OR '1'='1"}),
    C("lease: renew an unknown lease", "POST", MODEL + "/lease/renew", None, 404, "lease_not_found", "X-miLLM-Lease",
      headers={"X-miLLM-Lease": "lease_" + "a" * 40}),
    C("lease: release with a path", "DELETE", MODEL + "/lease", None, 400, "invalid_lease_request", "X-miLLM-Lease",
      headers={"X-miLLM-Lease": "../../etc/passwd"}),
    C("lease: an unknown model", "GET", "/api/models/nope/lease", None, 404, "model_not_found", ANY),
    # --- weights ---
    C("weights: begin on an unknown model", "POST", "/api/models/nope/weights/begin", None, 404, "model_not_found", ANY),
    C("weights: PUT on an unknown model", "PUT", "/api/models/nope/weights", b"\x00" * 64, 404, "model_not_found", ANY,
      content_type="application/octet-stream"),
    C("weights: PUT before begin", "PUT", MODEL + "/weights", b"garbage", 409, "weights_not_begun", ANY, "begin",
      content_type="application/octet-stream"),
    C("weights: commit on an unknown model", "POST", "/api/models/nope/weights/commit", None, 404, "model_not_found", ANY),
    C("weights: save an unknown model", "POST", "/api/models/' OR 1=1/save", None, 404, "model_not_found", ANY),
    # --- probes ---
    C("probes: a NaN weight", "POST", "/api/probes", probe().replace("0.1", "NaN", 1), 400, "invalid_json", None, "NaN"),
    C("probes: a weight of 1e999", "POST", "/api/probes", probe().replace("0.1", "1e999", 1), 400, "invalid_probe_request",
      "weights.0", "finite"),
    C("probes: a negative layer", "POST", "/api/probes", probe(layer=-1), 400, "invalid_probe_request", "layer"),
    C("probes: a layer of 10^30", "POST", "/api/probes", probe(layer=10**30), 409, "probe_model_mismatch", ANY, "layer", "0..1"),
    C("probes: the wrong width", "POST", "/api/probes", probe(weights=[0.1]), 409, "probe_model_mismatch", ANY,
      "weights: expected 64, got 1"),
    C("probes: a name of 200 characters", "POST", "/api/probes", probe(name="n" * 200), 400, "invalid_probe_request", "name", "128"),
    C("probes: aggregation median", "POST", "/api/probes", probe(aggregation="median"), 400, "invalid_probe_request", "aggregation"),
    C("probes: a norm_std of 0", "POST", "/api/probes", probe(norm_std=0), 400, "invalid_probe_request", "norm_std"),
    C("probes: a string body", "POST", "/api/probes", '"probe"', 400, "invalid_probe_request", None, "JSON object"),
    C("probes: an id that is SQL", "GET", "/api/probes/probe_' OR 1=1", None, 404, "probe_not_found", ANY),
    C("probes: delete a path", "DELETE", "/api/probes/..%2F..%2Fetc", None, 404, "not_found", ANY),
    C("score: no inputs", "POST", "/api/probes/score", score(inputs=[]), 400, "invalid_probe_score_request", "inputs"),
    C("score: 65 inputs", "POST", "/api/probes/score", score(inputs=[{"text": "x"}] * 65), 400, "invalid_probe_score_request",
      "inputs", "65", "64", "PROBE_SCORE_MAX_INPUTS"),
    C("score: text and messages", "POST", "/api/probes/score", score(inputs=[{"text": "x", "messages": USER}]), 400,
      "invalid_probe_score_request", "inputs.0", "exactly one"),
    C("score: prompt_tokens past the end", "POST", "/api/probes/score", score(inputs=[{"token_ids": [1, 2], "prompt_tokens": 5}]),
      400, "invalid_probe_score_request", "inputs.0.prompt_tokens", "5", "2"),
    C("score: a negative token id", "POST", "/api/probes/score", score(inputs=[{"token_ids": [-1]}]), 400,
      "invalid_probe_score_request", "inputs.0.token_ids.0"),
    C("score: an unknown window", "POST", "/api/probes/score", score(windows=["middle"]), 400, "invalid_probe_score_request",
      "windows.0"),
    C("score: 9 probes", "POST", "/api/probes/score", score(probe_ids=[f"probe_{i}" for i in range(9)]), 400,
      "invalid_probe_score_request", "probe_ids", "9", "8", "PROBE_SCORE_MAX_PROBES"),
    C("score: an unknown probe", "POST", "/api/probes/score", score(probe_ids=["probe_' OR 1=1"]), 404, "probe_not_found",
      "probe_ids"),
    C("score: a lone surrogate", "POST", "/api/probes/score", score().replace('"hi"', '"\\ud83d"'), 400, "invalid_json",
      "inputs.0.text", "surrogate"),
    C("score: 500 levels of nesting", "POST", "/api/probes/score", score(inputs="X").replace('"X"', "[" * 500 + "]" * 500),
      400, "invalid_json", ANY, "64 levels"),
    C("score: an unknown key", "POST", "/api/probes/score", score(explain=True), 400, "invalid_probe_score_request", "explain"),
    C("score: a text/plain body", "POST", "/api/probes/score", score(), 415, "unsupported_media_type", ANY,
      content_type="text/plain"),
]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, test_model_dir):
    """A stack with small upload limits; a real input file (FILE_ID); the row counts before the corpus."""
    with Stack.running(tmp_path_factory.mktemp("hostile"), test_model_dir, BATCH_WAIT_POLL_S=0.2, **LIMITS) as stack:
        seed = to_jsonl([line("seed", COMPLETIONS, {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1})])
        uploaded = httpx.post(stack.web.url + FILES, data={"purpose": "batch"}, files={"file": ("seed.jsonl", seed)})
        assert uploaded.status_code == 200, uploaded.text
        stack.file_id = uploaded.json()["id"]
        stack.before = stored(stack)
        yield stack


def stored(stack):
    """What a refusal must not change: the rows of every table a request can write, and the bytes."""
    counts = {table: stack.sql(f"SELECT count(*) FROM {table}")[0][0] for table in STORED_TABLES}
    leftovers = [str(path) for folder in ("tmp", "weights-uploads") if (stack.data_dir / folder).exists()
                 for path in (stack.data_dir / folder).iterdir()]
    return counts, stack.stored_files(), leftovers


def send(stack, case):
    body = case.body.replace(FILE_ID, stack.file_id) if isinstance(case.body, str) else case.body
    headers = {**({"Content-Type": case.content_type} if case.body is not None else {}), **case.headers}
    return httpx.request(case.method, stack.web.url + case.path.replace(FILE_ID, stack.file_id), content=body,
                         headers=headers, timeout=60)


def assert_envelope(response, path, status, code, param=ANY, says=()):
    """The documented refusal: status, envelope shape, code, the field and what the message names."""
    assert response.status_code == status, response.text[:500]
    assert response.headers["x-should-retry"] == "false"
    assert response.headers["X-Request-ID"]
    body = response.json()
    if path.startswith("/api/"):
        assert set(body) == {"success", "data", "error"}, body
        assert body["success"] is False and body["data"] is None
        error = body["error"]
        assert set(error) == {"code", "message", "details"}, error
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", error["code"]) and error["code"] == code.upper(), error
        assert isinstance(error["details"], dict)
        if param is not ANY:
            assert error["details"].get("field") == param, error
    else:
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["code"] == code and error["type"] == "invalid_request_error", error
        if param is not ANY:
            assert error["param"] == param, error
        if code == "invalid_parameter" and param not in (ANY, None):
            assert f"'{param}'" in error["message"], error
    assert error["message"]
    for fragment in says:
        assert fragment in error["message"], (fragment, error["message"])


def test_the_corpus_covers_every_route_with_at_least_60_cases():
    assert len(CORPUS) >= 60
    assert len({case.name for case in CORPUS}) == len(CORPUS)
    for route in (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, "/input_items", "/v1/models/", FILES, "/content", BATCHES, "/cancel", "/api/models",
                  "/load", "/unload", "/lease", "/lease/renew", "/weights/begin", "/weights", "/weights/commit", "/save",
                  "/api/probes", "/api/probes/score"):
        assert any(route in case.path for case in CORPUS), route


@pytest.mark.parametrize("case", CORPUS, ids=[case.name for case in CORPUS])
def test_hostile_input_gets_its_documented_4xx(hostile, case):
    response = send(hostile, case)
    assert_envelope(response, case.path, case.status, case.code, case.param, case.says)
    assert httpx.get(hostile.web.url + "/api/health", timeout=10).status_code == 200


# --- a 50 MB body: refused before it is read, or the moment it crosses the limit ---


def raw_request(url, head, chunks=()):
    """Send a request head, then body chunks until the server answers; return (status, body, bytes sent)."""
    host, port = url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=60) as connection:
        connection.sendall(head)
        for chunk in chunks:
            if answered(connection):
                break
            try:
                connection.sendall(chunk)
                sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        try:
            while chunk := connection.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), sent


def answered(connection):
    """Whether the server has answered (or closed), without waiting or consuming the answer."""
    readable, _, _ = select.select([connection], [], [], 0)
    return bool(readable)


@pytest.mark.parametrize("path,status,code,setting", [
    (CHAT, 413, "request_too_large", "MILLM_MAX_BODY_BYTES"),
    ("/api/probes/score", 413, "request_too_large", "MILLM_MAX_BODY_BYTES"),
    (BATCHES, 413, "request_too_large", "MILLM_MAX_BODY_BYTES"),
    (FILES, 400, "batch_file_limit", "BATCH_MAX_FILE_BYTES"),
])
def test_a_declared_50_mb_body_is_refused_before_a_byte_is_read(hostile, path, status, code, setting):
    before = peak_rss_mb(hostile.web.popen.pid)
    content_type = MULTIPART if path == FILES else "application/json"
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {FIFTY_MB}\r\n\r\n").encode()
    got, body, _ = raw_request(hostile.web.url, head)  # not one byte of the body is sent
    assert got == status, body
    error = body["error"]
    assert (error["code"] == code.upper()) if path.startswith("/api/") else (error["code"] == code)
    assert f"{FIFTY_MB:,} bytes declared" in error["message"] and setting in error["message"]
    assert peak_rss_mb(hostile.web.popen.pid) - before < 8


def test_a_chunked_50_mb_body_is_cut_off_at_the_limit_and_never_held_in_memory(hostile):
    httpx.post(hostile.web.url + CHAT, content="{", headers={"Content-Type": "application/json"})  # warm
    before = peak_rss_mb(hostile.web.popen.pid)
    def framed(data):
        return f"{len(data):x}\r\n".encode() + data + b"\r\n"

    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    opening = framed(b'{"model": "tiny-llama", "prompt": "')
    status, body, sent = raw_request(hostile.web.url, head + opening, [framed(b"x" * (1024 * 1024))] * 50)
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large"
    assert "MILLM_MAX_BODY_BYTES" in body["error"]["message"] and "33554432" in body["error"]["message"]
    assert sent < FIFTY_MB  # answered before the whole body was sent
    growth = peak_rss_mb(hostile.web.popen.pid) - before
    print(f"chunked 50 MB body: refused after {sent / 1e6:.0f} MB were sent; web peak RSS +{growth:.1f} MB")
    assert growth < 16, f"the web process grew {growth:.0f} MB while refusing a chunked 50 MB body"


# --- safetensors bodies, between a begin and a commit ---


WEIGHT_BODIES = [
    ("empty", b"", "empty"),
    ("seven bytes", b"garbage", "not a safetensors file"),
    ("a header length of 2^64-1", b"\xff" * 8 + b"{}", "not a safetensors file"),
    ("a header that is not JSON", (30).to_bytes(8, "little") + b'{"a":{"dtype":"F32","shape":[1],', "not a safetensors file"),
    ("no tensor", (2).to_bytes(8, "little") + b"{}", "names no tensor"),
]


def test_hostile_safetensors_bodies_are_refused_and_write_nothing(hostile):
    url = hostile.web.url + MODEL
    assert httpx.post(url + "/weights/begin").json()["data"]["weights"] == "torn"
    try:
        for name, body, says in WEIGHT_BODIES:
            response = httpx.put(url + "/weights", content=body, headers={"Content-Type": "application/octet-stream"})
            assert_envelope(response, "/api/", 400, "invalid_weights_request", ANY, (says,))
    finally:
        assert httpx.post(url + "/weights/commit").json()["data"]["weights"] == "clean"


# --- after the corpus ---


def test_nothing_was_stored_and_the_server_keeps_serving(hostile):
    assert stored(hostile) == hostile.before
    answer = httpx.post(hostile.web.url + CHAT, json={"model": MODEL_ID, "messages": USER, "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["role"] == "assistant"
    assert hostile.web.alive and hostile.engine.alive
    assert "Internal Server Error" not in hostile.web.log() and "unhandled error" not in hostile.web.log()
    assert "Traceback" not in hostile.engine.log()


# --- hostile input that is accepted: stored safely, as documented ---


def upload(stack, filename, data):
    return httpx.post(stack.web.url + FILES, data={"purpose": "batch"}, files={"file": (filename, data)}, timeout=30)


def test_a_filename_with_dot_dot_is_stored_inside_storage_under_the_files_id(hostile):
    response = upload(hostile, "../../../../tmp/escaped.jsonl", b"{}\n")
    assert response.status_code == 200, response.text
    uploaded = response.json()
    assert "/" not in uploaded["filename"] and ".." not in uploaded["filename"]
    ((storage_name,),) = hostile.sql("SELECT storage_name FROM files_app_file WHERE id = %s", [uploaded["id"]])
    assert storage_name == f"files/{uploaded['id']}.jsonl"
    assert (hostile.data_dir / storage_name).read_bytes() == b"{}\n"
    assert not list(hostile.work_dir.rglob("escaped.jsonl"))


def test_a_line_of_exactly_the_limit_and_exactly_the_row_limit_are_accepted(hostile):
    exact = upload(hostile, "exact.jsonl", jsonl_lines(MAX_LINE))
    assert exact.status_code == 200, exact.text
    assert exact.json()["bytes"] == MAX_LINE + 1
    rows = upload(hostile, "rows.jsonl", b"{}\n" * MAX_ROWS)
    assert rows.status_code == 200, rows.text
    assert hostile.sql("SELECT line_count FROM files_app_file WHERE id = %s", [rows.json()["id"]]) == [(MAX_ROWS,)]


def run_batch(stack, data):
    file_id = upload(stack, "in.jsonl", data).json()["id"]
    created = httpx.post(stack.web.url + BATCHES, json={"input_file_id": file_id, "endpoint": COMPLETIONS, "completion_window": "24h"})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]
    wait_until(lambda: httpx.get(stack.web.url + f"{BATCHES}/{batch_id}").json()["status"] in FINISHED, 60,
               f"{batch_id} did not end", stack.engine)
    ended = httpx.get(stack.web.url + f"{BATCHES}/{batch_id}").json()
    errors = [json.loads(row) for row in httpx.get(stack.web.url + f"{FILES}/{ended['error_file_id']}/content").text.splitlines()]
    return ended, errors


def test_a_file_of_only_blank_lines_is_accepted_and_its_batch_fails_empty_file(hostile):
    uploaded = upload(hostile, "blank.jsonl", b"\n\n   \n\t\n")
    assert uploaded.status_code == 200 and uploaded.json()["bytes"] == 8
    ended, errors = run_batch(hostile, b"\n\n   \n\t\n")
    assert ended["status"] == "failed"
    assert ended["errors"]["data"][0]["code"] == "empty_file" and ended["errors"]["data"][0]["line"] is None
    assert [(e["line"], e["error"]["code"]) for e in errors] == [(n, "invalid_json") for n in (1, 2, 3, 4)]
    assert all("blank" in e["error"]["message"] for e in errors)


def test_hostile_lines_fail_alone_and_the_valid_line_runs(hostile):
    """U+0000 and lone surrogates cannot be stored: once they jammed validation for every batch."""
    good = json.dumps(line("good", COMPLETIONS, {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1}))
    lines = [
        good.replace('"good"', '"nul\\u0000"'),
        good.replace('"good"', '"b"').replace('"hi"', '"a\\u0000b"'),
        good.replace('"good"', '"c"').replace('"hi"', '"\\ud800"'),
        good.replace('"good"', '"d"').replace('"max_tokens": 1', '"max_tokens": NaN'),
        good.replace('"good"', '"e"').replace('"hi"', '[' * 50 + ']' * 50),
        good.replace('"good"', '"f"').replace('"hi"', '[' * 66 + ']' * 66),
        good,
    ]
    ended, errors = run_batch(hostile, "\n".join(lines).encode() + b"\n")
    assert ended["status"] == "completed", ended
    assert ended["request_counts"] == {"total": 7, "completed": 1, "failed": 6}
    assert [(e["line"], e["custom_id"], e["error"]["code"]) for e in errors] == [
        (1, None, "invalid_json"), (2, "b", "invalid_json"), (3, "c", "invalid_json"), (4, "d", "invalid_json"),
        (5, "e", "invalid_parameter"), (6, "f", "invalid_json")]
    assert "U+0000" in errors[0]["error"]["message"] and "surrogate" in errors[2]["error"]["message"]
    assert "64 levels" in errors[5]["error"]["message"]
    assert "Traceback" not in hostile.engine.log()
