"""The bodies the Responses API sends (millm_lib.shapes says how a shape builds and documents them)."""

from typing import Annotated, Any, Literal, Union

from pydantic import Field
from typing_extensions import NotRequired

from millm_lib.shapes import Shape

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Shape):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class MessageOutput(Shape):
    type: Literal["message"]
    id: Annotated[str, Field(pattern=r"^msg_")]
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallOutput(Shape):
    type: Literal["function_call"]
    id: Annotated[str, Field(pattern=r"^fc_")]
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class InputTokensDetails(Shape):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(Shape):
    reasoning_tokens: int


class ResponseUsage(Shape):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Shape):
    reason: Literal["max_output_tokens"]


class ResponseError(Shape):
    code: str
    message: str


class Response(Shape):
    id: Annotated[str, Field(pattern=r"^resp_")]
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[Union[MessageOutput, FunctionCallOutput]]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, str]]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    user: str | None
    background: bool
    reasoning: dict[str, None]
    service_tier: str


class StreamEvent(Shape):
    """One server-sent event of a streamed response (its `event:` line is its type)."""
    type: Literal[
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed", "response.incomplete", "response.failed",
    ]
    sequence_number: int
    response: NotRequired[Response]
    item: NotRequired[dict[str, Any]]
    item_id: NotRequired[str]
    output_index: NotRequired[int]
    content_index: NotRequired[int]
    delta: NotRequired[str]
    text: NotRequired[str]
    arguments: NotRequired[str]


class InputItem(Shape):
    """A stored input item: a message, a function call or a function call's output."""
    id: str
    type: Literal["message", "function_call", "function_call_output"]
    status: ItemStatus


class InputItemList(Shape):
    object: Literal["list"]
    data: list[InputItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(Shape):
    id: str
    object: Literal["response"]
    deleted: Literal[True]
