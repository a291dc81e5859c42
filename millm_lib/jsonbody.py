"""Request bodies as JSON: decoded once, with the refusals every route and batch line shares
(malformed JSON, nesting too deep, U+0000, lone surrogates)."""

import json

from millm_lib.errors import ApiError

# Arrays and objects inside one another: a request needs a handful of levels (chat: 5).
MAX_JSON_DEPTH = 64


def decode_json(raw):
    """Bytes to a JSON object, or the 400 the routes answer for malformed JSON."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        value = json.loads(text, parse_constant=_refuse_constant)
    except UnicodeDecodeError as error:
        raise ApiError(400, "invalid_json", f"Request body is not valid UTF-8: {error.reason} at byte {error.start}")
    except RecursionError:
        raise ApiError(400, "invalid_json", f"Request body is nested too deeply to parse (the limit is {MAX_JSON_DEPTH} levels)")
    except ValueError as error:
        raise ApiError(400, "invalid_json", f"Request body is not valid JSON: {error}")
    unusable = None if isinstance(raw, (bytes, bytearray)) and plainly_usable(text) else unusable_text(value)
    if unusable is not None:
        path, what = unusable
        raise ApiError(400, "invalid_json", f"Request body is not usable JSON: '{path or 'body'}' {what}",
                       param=path or None)
    return value


def plainly_usable(text):
    """True when JSON text decoded from UTF-8 bytes cannot hold what unusable_text() looks for:
    U+0000 and lone surrogates need a \\u escape there (raw, they are not valid JSON or UTF-8),
    and nesting needs brackets. Most requests and batch lines pass, and skip the walk."""
    return "\\u" not in text and text.count("[") + text.count("{") <= MAX_JSON_DEPTH


def unusable_text(value):
    """(dotted path, what is wrong) of the first string, key or value, holding U+0000 or an unpaired
    surrogate, or of the first array or object nested deeper than MAX_JSON_DEPTH; None when there
    is none. JSON's \\u escapes can spell both characters, but PostgreSQL cannot store U+0000 and
    UTF-8 cannot encode a lone surrogate (the tokenizer refuses it); deeper nesting than any
    request needs would exhaust the recursion of the validators. So the routes and batch lines
    refuse them up front. Iterative: the walk itself has no depth limit."""
    stack = [((), value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, (dict, list)) and len(path) >= MAX_JSON_DEPTH:
            return ".".join(map(str, path)), f"is nested more than {MAX_JSON_DEPTH} levels deep"
        if isinstance(item, dict):
            for key in item:
                if what := _unusable(key):
                    return ".".join(map(str, path)), f"has a key holding {what}"
            stack.extend(((*path, key), child) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend(((*path, index), child) for index, child in reversed(list(enumerate(item))))
        elif isinstance(item, str) and (what := _unusable(item)):
            return ".".join(map(str, path)), f"holds {what}"
    return None


def _unusable(text):
    if "\x00" in text:
        return "U+0000 (a NUL character, \\u0000), which cannot be stored"
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"an unpaired surrogate (\\u{ord(text[error.start]):04x}), which is not Unicode text"
    return None


def _refuse_constant(name):
    raise ValueError(f"{name} is not allowed in JSON")
