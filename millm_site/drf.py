"""DRF's own errors (parse errors, 404, 405, 415) in the /v1 envelope."""

from rest_framework import exceptions

from inference_app.errors import ApiError, error_response

CODES = {
    exceptions.ParseError: "invalid_json",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.NotAcceptable: "not_acceptable",
}


def exception_handler(exc, context):
    if isinstance(exc, ApiError):
        return error_response(exc)
    if isinstance(exc, exceptions.APIException):
        code = next((code for kind, code in CODES.items() if isinstance(exc, kind)), "invalid_request")
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if isinstance(exc, exceptions.UnsupportedMediaType):
            view = context.get("view")
            accepted = ", ".join(parser.media_type for parser in getattr(view, "parser_classes", []))
            detail = f"{detail} Send {accepted}." if accepted else detail
        return error_response(ApiError(exc.status_code, code, detail))
    return None
