"""The error envelopes of SPEC section 2, and the one exception class that carries them.

`/v1` routes answer `{"error": {message, type, param, code}}`; `/api` management routes answer
`{"success": false, "data": null, "error": {code, message, details}}`. Code anywhere (web or
engine, route or batch row) raises ApiError; the edge renders it in the envelope of its route.
"""

import json
import math

from django.http import HttpResponse

from millm_lib.shapes import ManagementError, ManagementErrorBody, OpenAIError, OpenAIErrorBody

TYPE_BY_STATUS = {401: "authentication_error", 429: "rate_limit_error"}
HEALTH_PATHS = ("/api/health",)


def is_v1(path):
    return path == "/v1" or path.startswith("/v1/")


def is_management(path):
    """A management route answers in the management envelope; health answers in neither."""
    return path.startswith("/api/") and not path.startswith(HEALTH_PATHS)


class ApiError(Exception):
    def __init__(self, status, code, message, param=None, error_type=None, retry_after=None, details=None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.type = error_type or _default_type(status)
        self.retry_after = retry_after
        self.details = details

    def body(self):
        error = OpenAIErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        if self.details:  # what a refusal measured (a quota's name, limit and use), beside OpenAI's four
            error["details"] = self.details
        return OpenAIError(error=error)

    def management_body(self):
        return ManagementError(
            success=False,
            data=None,
            # The field goes in details when nothing more precise does (the envelope has no param).
            error=ManagementErrorBody(code=self.code.upper(), message=self.message,
                                      details=self.details or ({"field": self.param} if self.param else {})),
        )

    def to_wire(self):
        """A plain dict that crosses the channel layer and becomes an ApiError again."""
        return {
            "status": self.status,
            "code": self.code,
            "message": self.message,
            "param": self.param,
            "type": self.type,
            "retry_after": self.retry_after,
            "details": self.details,
        }

    @classmethod
    def from_wire(cls, data):
        return cls(
            data["status"],
            data["code"],
            data["message"],
            param=data.get("param"),
            error_type=data.get("type"),
            retry_after=data.get("retry_after"),
            details=data.get("details"),
        )


def _default_type(status):
    if status in TYPE_BY_STATUS:
        return TYPE_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def json_response(body, status=200, headers=None):
    response = HttpResponse(
        json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")),
        status=status,
        content_type="application/json",
    )
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def error_response(error, management=False, headers=None):
    body = error.management_body() if management else error.body()
    response = json_response(body, status=error.status, headers=headers)
    if error.status == 503 or error.retry_after is not None:
        response["Retry-After"] = str(int(math.ceil(error.retry_after or 5)))
    response.millm_envelope = True
    return response


def require_json(request):
    """415 unless the body is declared application/json."""
    content_type = request.content_type or ""
    if content_type != "application/json":
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Send the body as application/json (Content-Type: application/json), got {content_type or 'none'!r}",
        )


def internal_error():
    return ApiError(500, "server_error", "An internal server error occurred.")


def invalid_value(param, reason):
    """A request field whose value cannot be served (a schema, a tool, a grammar), named."""
    return ApiError(400, "invalid_request_error", f"Invalid value for '{param}': {reason}", param=param)


def not_found_route(method, path):
    return ApiError(404, "not_found", f"Unknown route: {method} {path}")


def method_not_allowed(method, path, allowed):
    return ApiError(
        405,
        "method_not_allowed",
        f"Method {method} is not allowed on {path}; allowed: {', '.join(allowed) or 'none'}",
    )


def request_too_large(measured, limit, setting="MILLM_MAX_BODY_BYTES"):
    return ApiError(
        413,
        "request_too_large",
        f"Request body is {measured}, over the limit of {limit} bytes ({setting})",
    )
