"""DRF's own errors (parse errors, 404, 405, 415) in the /v1 envelope, and its JSON parser."""

from rest_framework import exceptions, parsers

from millm_lib.errors import ApiError, error_response, is_management
from millm_lib.jsonbody import decode_json

CODES = {
    exceptions.ParseError: "invalid_json",
    exceptions.NotFound: "not_found",
    exceptions.MethodNotAllowed: "method_not_allowed",
    exceptions.UnsupportedMediaType: "unsupported_media_type",
    exceptions.NotAcceptable: "not_acceptable",
}


def exception_handler(exc, context):
    if isinstance(exc, ApiError):
        return error_response(exc, management=_management(context))
    if isinstance(exc, exceptions.APIException):
        code = next((code for kind, code in CODES.items() if isinstance(exc, kind)), "invalid_request")
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        request = context.get("request")
        if isinstance(exc, exceptions.ParseError) and request is not None and request.content_type.startswith("multipart/"):
            # Only uploads take multipart: a body that cannot be read has no file part (SPEC 2).
            return error_response(ApiError(400, "invalid_batch_request", f"The upload could not be read: {detail}", param="file"))
        if isinstance(exc, exceptions.UnsupportedMediaType):
            view = context.get("view")
            accepted = ", ".join(parser.media_type for parser in getattr(view, "parser_classes", []))
            detail = f"{detail} Send {accepted}." if accepted else detail
        return error_response(ApiError(exc.status_code, code, detail), management=_management(context))
    return None


def _management(context):
    """DRF serves /api/schema/ too: its errors take the management envelope (SPEC 2)."""
    request = context.get("request")
    return request is not None and is_management(request.path)


class JSONParser(parsers.JSONParser):
    """The routes' own decoding (millm_lib.jsonbody.decode_json): the same refusals for the same bodies,
    nesting too deep, U+0000 and lone surrogates included."""

    def parse(self, stream, media_type=None, parser_context=None):
        return decode_json(stream.read())
