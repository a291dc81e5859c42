"""Response shapes: the bodies the server sends are built by calling these classes, and the
OpenAPI schema (millm_lib.openapi) is generated from the very same classes.

A shape is a TypedDict: calling one returns a plain dict in the order of its keywords, so a
streamed token or a batch row costs no more than a dict literal would, and pydantic's
`TypeAdapter(shape).json_schema()` documents it. Keys left out of a call are absent from the
body; `NotRequired` marks the keys a body may leave out.
"""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12


@with_config(ConfigDict(extra="allow"))
class Shape(TypedDict):
    """A documented response object; keys beyond the declared ones may be added later."""


# --- the error envelopes (SPEC 2) ---


class OpenAIErrorBody(Shape):
    message: str
    type: Literal["invalid_request_error", "server_error", "rate_limit_error", "authentication_error"]
    param: str | None
    code: str | None


class OpenAIError(Shape):
    """Every /v1 error, framework errors included (SPEC 2)."""

    error: OpenAIErrorBody


class ManagementErrorBody(Shape):
    code: Annotated[str, Field(pattern=r"^[A-Z0-9_]+$")]
    message: str
    details: dict[str, Any]


class ManagementError(Shape):
    """Every /api error (SPEC 2)."""

    success: Literal[False]
    data: None
    error: ManagementErrorBody


class ManagementSuccess(Shape):
    """Every /api answer: `data` is the route's own shape (documented by millm_lib.openapi.data)."""

    success: Literal[True]
    data: Any
    error: None
