"""The OpenAPI schema served at /api/schema/ (drf-spectacular, OpenAPI 3.1): the glue only.

Each app documents its routes next to them: DRF viewsets with drf-spectacular's
`extend_schema_view`, plain Django views with `@documented(GET=Op(...))`. `add_plain_views`, a
postprocessing hook, walks the URL resolver and reads each plain view's methods (its
`require_http_methods`) and operations (its `@documented`); a route without them stops schema
generation (tests/e2e/test_openapi.py checks it too). Bodies are documented from the classes the
server builds them with: response shapes (millm_lib.shapes), pydantic request models.

Errors: `/v1` routes answer OpenAI's envelope (`OpenAIError`), `/api` routes the management
envelope (`ManagementError`), health and metrics have none (SPEC 2). The schema needs a bearer key
when MILLM_API_KEYS is set, like every route but health (SPEC 1).
"""

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.urls import URLPattern, URLResolver, get_resolver
from drf_spectacular.drainage import set_override
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.plumbing import ResolvedComponent
from drf_spectacular.renderers import OpenApiJsonRenderer2
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from drf_spectacular.views import SpectacularJSONAPIView
from pydantic import TypeAdapter
from typing_extensions import is_typeddict

from millm_lib.ids import path_id_schema
from millm_lib.shapes import ManagementError, OpenAIError, Shape

REF = "#/components/schemas/{model}"
JSON = "application/json"
# Not part of the API: the admin (staff login, HTML).
EXCLUDED_NAMESPACES = ("admin",)
_adapter = functools.cache(TypeAdapter)


def json_schema(shape, mode="serialization"):
    """A response shape's or a pydantic request model's JSON schema, nested ones in `$defs`."""
    return _adapter(shape).json_schema(ref_template=REF, mode=mode)


class ShapeExtension(OpenApiSerializerExtension):
    """drf-spectacular takes a response shape wherever it takes a serializer."""

    target_class = Shape

    @classmethod
    def _matches(cls, target):
        return is_typeddict(target)

    def get_name(self, auto_schema, direction):
        # Nested shapes are registered by name below; the same class met again is no collision.
        set_override(self.target, "suppress_collision_warning", True)
        return self.target.__name__

    def map_serializer(self, auto_schema, direction):
        schema = json_schema(self.target)
        for name, sub in schema.pop("$defs", {}).items():
            component = ResolvedComponent(name=name, type=ResolvedComponent.SCHEMA, object=name, schema=sub)
            auto_schema.registry.register_on_missing(component)
        return schema


# --- what the apps document their routes with ---

IDEMPOTENCY_HEADER = OpenApiParameter("Idempotency-Key", str, OpenApiParameter.HEADER,
                                      description="The same key answers the first object again for 24 hours")
PATH_ID = OpenApiParameter("id", path_id_schema("id"), OpenApiParameter.PATH)


def drf_errors():
    """A DRF route's refusals and failures: OpenAI's envelope."""
    return {"4XX": OpenApiResponse(OpenAIError, "Refused, in OpenAI's envelope"),
            "5XX": OpenApiResponse(OpenAIError, "Unavailable or failed, in OpenAI's envelope")}


def header(name, schema, description):
    """A request header of a plain view's operation."""
    return {"name": name, "in": "header", "required": False, "schema": schema, "description": description}


@dataclass(frozen=True)
class Op:
    summary: str
    responses: dict  # status -> a Shape class, a JSON schema dict, or (media type -> either)
    request: Any = None  # a pydantic model, or a dict of media type -> JSON schema
    request_required: bool = True
    headers: tuple = ()
    envelope: str = "v1"  # "v1", "management" or "none": which error envelope its errors use


def data(shape):
    """The management success envelope (ManagementSuccess) around `shape`."""
    return {"type": "object", "required": ["success", "data", "error"],
            "properties": {"success": {"const": True}, "data": shape, "error": {"type": "null"}}}


def sse(chunk):
    """Server-sent events: each `data:` a JSON chunk (or an error), then `data: [DONE]`."""
    payload = {"anyOf": [chunk, OpenAIError]}
    return {"type": "object", "description": "One server-sent event; the last one's data is [DONE]",
            "required": ["data"], "properties": {"data": {"anyOf": [
                {"const": "[DONE]"}, {"type": "string", "contentMediaType": JSON, "contentSchema": payload}]}}}


def documented(**operations):
    """A plain view's operations by method, read by `add_plain_views`: `@documented(GET=Op(...))`,
    outermost, so that the view the URL resolver holds carries them."""
    def decorate(view):
        view.openapi_operations = operations
        return view
    return decorate


def dotted(view):
    return f"{view.__module__}.{view.__qualname__}"


def plain_routes(patterns=None, prefix="/"):
    """(OpenAPI path, view) of every route neither DRF's (drf-spectacular has those) nor excluded.
    A Django route becomes a path template: `<path:model_id>` -> `{model_id}`."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        route = prefix + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", str(entry.pattern))
        if isinstance(entry, URLResolver) and entry.namespace not in EXCLUDED_NAMESPACES:
            yield from plain_routes(entry.url_patterns, route)
        elif isinstance(entry, URLPattern) and not hasattr(entry.callback, "cls"):
            yield route, entry.callback


def route_methods(view):
    """The methods a plain view allows, read from its require_http_methods decorator."""
    func = view
    while func is not None:
        closure = inspect.getclosurevars(func).nonlocals if func.__closure__ else {}
        if "request_method_list" in closure:
            return sorted(method.upper() for method in closure["request_method_list"])
        func = getattr(func, "__wrapped__", None)
    raise ImproperlyConfigured(f"{dotted(view)} allows every method: decorate it with require_http_methods")


class Components:
    """Component schemas from shapes and request models: `$defs` hoisted, each name defined once."""

    def __init__(self, schemas):
        self.schemas = schemas

    def add(self, name, schema):
        known = self.schemas.get(name)
        if known is not None and known != schema:
            raise ImproperlyConfigured(f"two different OpenAPI components are named {name}")
        self.schemas[name] = schema

    def ref(self, model, mode="serialization"):
        schema = json_schema(model, mode)
        for name, sub in schema.pop("$defs", {}).items():
            self.add(name, sub)
        self.add(model.__name__, schema)
        return {"$ref": REF.format(model=model.__name__)}

    def resolve(self, value):
        """A JSON schema in which every shape becomes a ref to its component."""
        if is_typeddict(value):
            return self.ref(value)
        if isinstance(value, dict):
            return {key: self.resolve(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.resolve(item) for item in value]
        return value


def _operation(path, method, view, op, components):
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": path_id_schema(name)}
        for name in re.findall(r"{([^}]+)}", path)
    ] + [dict(header) for header in op.headers]
    responses = {}
    for status, body in op.responses.items():
        content = body if isinstance(body, dict) and all("/" in key for key in body) else {JSON: body}
        responses[str(status)] = {
            "description": op.summary,
            "content": {media: {"schema": components.resolve(schema)} for media, schema in content.items()},
        }
    if op.envelope != "none":
        error = {JSON: {"schema": components.ref(OpenAIError if op.envelope == "v1" else ManagementError)}}
        responses["4XX"] = {"description": "Refused", "content": error}
        responses["5XX"] = {"description": "Unavailable or failed (503 carries Retry-After)", "content": error}
    operation = {"operationId": f"{view.__name__}_{method.lower()}", "summary": op.summary, "tags": [_tag(path)],
                 "parameters": parameters, "responses": responses}
    if op.request is not None:
        content = ({JSON: {"schema": components.ref(op.request, mode="validation")}} if isinstance(op.request, type)
                   else {media: {"schema": schema} for media, schema in op.request.items()})
        operation["requestBody"] = {"required": op.request_required, "content": content}
    return operation


def _tag(path):
    parts = path.strip("/").split("/")
    return parts[1] if parts[0] in ("v1", "api") and len(parts) > 1 else parts[0]


def add_plain_views(result, generator, request, public):
    """drf-spectacular postprocessing hook: every plain Django route, from the URL resolver."""
    components = Components(result.setdefault("components", {}).setdefault("schemas", {}))
    paths = result.setdefault("paths", {})
    for path, view in plain_routes():
        operations = getattr(view, "openapi_operations", None)
        if operations is None:
            raise ImproperlyConfigured(f"{path} ({dotted(view)}) is not documented: decorate it with @documented")
        item = paths.setdefault(path, {})
        for method in route_methods(view):
            if method not in operations:
                raise ImproperlyConfigured(f"{method} {path} ({dotted(view)}) is missing from its @documented")
            item[method.lower()] = _operation(path, method, view, operations[method], components)
    components.ref(OpenAIError)
    components.ref(ManagementError)
    result["components"]["securitySchemes"] = {"bearer": {
        "type": "http", "scheme": "bearer", "description": "A key from MILLM_API_KEYS, when it is set"}}
    # A key is needed only when MILLM_API_KEYS is set: `{}` says no key is also accepted then.
    result["security"] = [{"bearer": []}, {}]
    for path, item in paths.items():
        for operation in item.values():
            # drf-spectacular marks its own views public (AllowAny); the key middleware decides.
            operation.pop("security", None)
            if path.startswith("/api/health"):
                operation["security"] = [{}]  # health never needs a key (SPEC 1)
    result["paths"] = dict(sorted(paths.items()))
    return result


class SchemaView(SpectacularJSONAPIView):
    """GET /api/schema/: this schema, as application/json whatever Accept says."""

    renderer_classes = [OpenApiJsonRenderer2]

    @extend_schema(summary="This OpenAPI 3.1 schema", responses={
        200: OpenApiResponse({"type": "object", "required": ["openapi", "info", "paths"]}),
        "4XX": ManagementError, "5XX": ManagementError})
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    def perform_content_negotiation(self, request, force=False):
        return super().perform_content_negotiation(request, force=True)
