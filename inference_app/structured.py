"""What a request asks its answer to be (`response_format`, issue 29, point 1), checked where the
request is parsed, so web processes and batch validation refuse a bad schema without the engine.

A `json_schema` must stay inside the JSON Schema subset OpenAI's structured outputs support
(SPEC 4a): objects, arrays, strings, numbers, integers, booleans, null, `enum`, `const`, `anyOf`,
`$defs`/`$ref`; with `strict: true` every object also lists all its properties in `required` and
sets `additionalProperties: false`. Anything else is 400 `invalid_request_error` naming the path
of the first offending keyword. The engine compiles what passes (inference_app/engine/grammars.py).

This module imports neither torch nor the engine.
"""

import hashlib
import json

from millm_lib.errors import invalid_value

# The keywords a schema may use; each is enforced while decoding.
KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "$defs",
    "definitions", "$ref", "description", "title", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "minItems", "maxItems", "minLength", "maxLength", "$schema", "$id", "strict",
}
TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
MAX_DEPTH = 10  # OpenAI's nesting limit
MAX_PROPERTIES = 5000


def grammar_kind(response_format):
    """'json_object', 'json_schema', or None for text (or nothing sent)."""
    kind = (response_format or {}).get("type", "text")
    return None if kind == "text" else kind


def schema_of(response_format):
    """The JSON schema a constrained answer follows."""
    if grammar_kind(response_format) == "json_object":
        return {"type": "object"}
    return response_format["json_schema"]["schema"]


def grammar_sha(response_format):
    """A short hash of what the answer is constrained to (the X-miLLM-Grammar header, the cache
    key). Keys keep their order: properties are generated in the order the schema gives them."""
    canonical = json.dumps([grammar_kind(response_format), schema_of(response_format)], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def check_response_format(response_format, param):
    """Refuse a `response_format` the grammar cannot enforce, naming the path (`param` is the
    field's own, with any batch line prefix)."""
    kind = grammar_kind(response_format)
    if kind not in (None, "json_object", "json_schema"):
        raise invalid_value(f"{param}.type", f"expected 'text', 'json_object' or 'json_schema', got {json.dumps(kind)[:80]}")
    if kind != "json_schema":
        return
    described = response_format.get("json_schema")
    if not isinstance(described, dict):
        raise invalid_value(f"{param}.json_schema", "a json_schema response_format needs an object {name, schema, strict}")
    name = described.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise invalid_value(f"{param}.json_schema.name", "a name of 1 to 64 characters is required")
    strict = described.get("strict", False)
    if not isinstance(strict, bool):
        raise invalid_value(f"{param}.json_schema.strict", f"expected true or false, got {json.dumps(strict)[:80]}")
    check_schema(described.get("schema"), f"{param}.json_schema.schema", strict)


def check_schema(schema, path, strict):
    """Refuse a JSON schema outside the subset (or, when `strict`, outside its strict rules),
    naming the path of the first offence; a response format's schema and a tool's parameters."""
    if not isinstance(schema, dict):
        raise invalid_value(path, "a JSON schema (an object) is required")
    if strict and schema.get("type") != "object":
        raise invalid_value(f"{path}.type", "a strict schema's root must be an object ({\"type\": \"object\", ...})")
    _check_node(schema, path, strict, 0, schema, [0])


def _check_node(node, path, strict, depth, root, counted):
    if not isinstance(node, dict):
        raise invalid_value(path, f"a schema must be an object, got {json.dumps(node)[:80]}")
    if depth > MAX_DEPTH:
        raise invalid_value(path, f"nested more than {MAX_DEPTH} levels, the limit of structured outputs")
    for key in node:
        if key not in KEYWORDS:
            raise invalid_value(f"{path}.{key}", f"'{key}' is outside the JSON Schema subset structured outputs enforce "
                                            f"(supported: {', '.join(sorted(KEYWORDS - {'strict'}))})")
    types = node.get("type")
    for kind in types if isinstance(types, list) else [types] if types is not None else []:
        if not isinstance(kind, str) or kind not in TYPES:
            raise invalid_value(f"{path}.type", f"unknown type {json.dumps(kind)[:80]}")
    if "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith(("#/$defs/", "#/definitions/"))) \
                or _resolve(root, ref) is None:
            raise invalid_value(f"{path}.$ref", f"{json.dumps(ref)[:80]} does not name a definition of this schema")
    properties = node.get("properties", {})
    if not isinstance(properties, dict):
        raise invalid_value(f"{path}.properties", "expected an object of property schemas")
    counted[0] += len(properties)
    if counted[0] > MAX_PROPERTIES:
        raise invalid_value(f"{path}.properties", f"over {MAX_PROPERTIES} properties in all, the limit of structured outputs")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise invalid_value(f"{path}.required", "expected a list of property names")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in node
    if strict and is_object:
        if node.get("additionalProperties") is not False:
            raise invalid_value(f"{path}.additionalProperties", "a strict schema needs additionalProperties: false on every object")
        missing = [name for name in properties if name not in required]
        if missing:
            raise invalid_value(f"{path}.required", f"a strict schema requires every property; {missing[0]!r} is not listed")
    for name, child in properties.items():
        _check_node(child, f"{path}.properties.{name}", strict, depth + 1, root, counted)
    if isinstance(node.get("additionalProperties"), dict):
        _check_node(node["additionalProperties"], f"{path}.additionalProperties", strict, depth + 1, root, counted)
    if "items" in node:
        _check_node(node["items"], f"{path}.items", strict, depth + 1, root, counted)
    if "anyOf" in node:
        if not isinstance(node["anyOf"], list) or not node["anyOf"]:
            raise invalid_value(f"{path}.anyOf", "expected a non-empty list of schemas")
        for index, child in enumerate(node["anyOf"]):
            _check_node(child, f"{path}.anyOf.{index}", strict, depth + 1, root, counted)
    for defs in ("$defs", "definitions"):
        if not isinstance(node.get(defs, {}), dict):
            raise invalid_value(f"{path}.{defs}", "expected an object of named schemas")
        for name, child in node.get(defs, {}).items():
            _check_node(child, f"{path}.{defs}.{name}", strict, depth + 1, root, counted)
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise invalid_value(f"{path}.enum", "expected a non-empty list of values")


def _resolve(root, ref):
    node = root
    for part in ref.lstrip("#").strip("/").split("/") if ref != "#" else []:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None
    return node
