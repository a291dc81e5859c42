"""Provenance headers (SPEC section 3): one builder for the routes and for batch output lines."""

import http_sfv

from millm_lib.limits import CHAT

IGNORED_FIELDS_MAX_BYTES = 1024


def system_fingerprint(model_id, revision, dtype, quantization, weights="dense", compiled=False):
    """SPEC 3: millm:<model id>@<revision or unrecorded>:<dtype>/<quant or none>[+packed][+compiled]:transformers
    (`+packed`: the quantized tensors run from their packed blocks, SPEC 7a; `+compiled`: decode
    steps run compiled, MILLM_COMPILE=decode)."""
    packed = "+packed" if weights == "packed" else ""
    compiled = "+compiled" if compiled else ""
    return (f"millm:{model_id}@{revision or 'unrecorded'}:{dtype}/{quantization or 'none'}{packed}{compiled}"
            ":transformers")


def provenance_headers(model_id, endpoint, request=None, ignored=()):
    headers = {"X-miLLM-Model": model_id, "X-miLLM-Backend": "serial"}
    seed = getattr(request, "seed", None)
    if seed is not None:
        item = http_sfv.Item(seed)
        item.params["scope"] = "request"
        headers["X-miLLM-Seed"] = str(item)
    if endpoint == CHAT:
        headers["X-miLLM-Batch"] = "1"
    if ignored:
        headers["X-miLLM-Ignored-Fields"] = ignored_fields_header(ignored)
    return headers


def ignored_fields_header(paths):
    """An RFC 8941 list of strings, in request order, cut to 1,024 bytes ending "+N more"."""
    items = [_sf_string(path) for path in paths]
    whole = ", ".join(items)
    if len(whole) <= IGNORED_FIELDS_MAX_BYTES:
        return whole
    kept, size = [], 0
    for index, item in enumerate(items):
        more = _sf_string(f"+{len(items) - index - 1} more")
        if size + len(item) + 2 + len(more) + 2 > IGNORED_FIELDS_MAX_BYTES:
            break
        kept.append(item)
        size += len(item) + 2
    return ", ".join([*kept, _sf_string(f"+{len(items) - len(kept)} more")])


def _sf_string(value):
    # RFC 8941 strings are printable ASCII; anything else (control characters included) is
    # escaped the Python way first.
    if not all(32 <= ord(char) < 127 for char in value):
        value = "".join(
            char if 32 <= ord(char) < 127 else char.encode("unicode_escape").decode("ascii") for char in value
        )
    return str(http_sfv.Item(value))
