"""The bodies the Files API sends (built by calling these shapes, documented from them) and the
multipart upload it takes, as /api/schema/ shows them."""

from typing import Annotated, Literal

from drf_spectacular.utils import extend_schema_serializer
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from millm_lib.limits import EXPIRES_AFTER_MAX_S, EXPIRES_AFTER_MIN_S
from millm_lib.shapes import Shape


class FileObject(Shape):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed", "error"]
    status_details: str | None


@extend_schema_serializer(many=False)
class FileList(Shape):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(Shape):
    id: str
    object: Literal["file"]
    deleted: Literal[True]


def _no_default(schema):
    schema.pop("default", None)


class FileUpload(BaseModel):
    """POST /v1/files, multipart."""

    # The expiry is both parts or neither.
    model_config = ConfigDict(populate_by_name=True, json_schema_extra={"dependentRequired": {
        "expires_after[anchor]": ["expires_after[seconds]"], "expires_after[seconds]": ["expires_after[anchor]"],
    }})
    file: Annotated[bytes, Field(description="The JSONL file")]
    purpose: Literal["batch"]
    # Multipart parts are never null: an unsent part is left out.
    expires_after_anchor: Literal["created_at"] | SkipJsonSchema[None] = Field(
        None, alias="expires_after[anchor]", json_schema_extra=_no_default
    )
    expires_after_seconds: Annotated[int, Field(ge=EXPIRES_AFTER_MIN_S, le=EXPIRES_AFTER_MAX_S)] | SkipJsonSchema[None] = Field(
        None, alias="expires_after[seconds]", json_schema_extra=_no_default
    )
