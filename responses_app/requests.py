"""The body of `POST /v1/responses` (issue 30, SPEC 4a): the text subset of OpenAI's Responses
API, and the chat completion request it is served as.

A response is a chat completion in other clothes. `ResponseRequest.chat_body(context)` writes
the chat request that answers it (instructions as the system message, then the conversation so
far, then this input), so the same prompt and settings give the same text as
`/v1/chat/completions`, through the same service code, grammars and provenance headers. The
request is checked by building that chat request and parsing it with the chat route's own
`parse_request`, whose refusals are renamed to this body's fields.

Registered with `inference_app.schemas` (apps.py), so the route, batch validation and the batch
runner parse a `/v1/responses` body with the same `parse_request`. No torch, no database.
"""

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr

from inference_app.schemas import (
    FunctionName,
    NonEmptyStr,
    PositiveInt,
    Schema,
    Seed,
    Temperature,
    TopP,
    parse_request,
)
from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from millm_lib.limits import CHAT

METADATA_MAX_KEYS = 16  # OpenAI's limits on metadata
METADATA_KEY_MAX = 64
METADATA_VALUE_MAX = 512
ItemId = Annotated[StrictStr, Field(max_length=128)]
Status = Literal["in_progress", "completed", "incomplete"]


# --- input items ---


class InputTextPart(Schema):
    type: Literal["input_text"]
    text: StrictStr


class OutputTextPart(Schema):
    """An earlier answer's text, sent back as input (`response.output` echoed by the SDK)."""
    type: Literal["output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(Schema):
    type: Literal["refusal"]
    refusal: StrictStr


class UnservedPart(Schema):
    """Images, files and audio: a text model cannot read them (a 400 naming the part)."""
    type: Literal["input_image", "input_file", "input_audio"]


Part = Union[InputTextPart, OutputTextPart, RefusalPart, UnservedPart]


class MessageItem(Schema):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[StrictStr, Annotated[list[Part], Field(min_length=1)]]
    id: ItemId | None = None
    status: Status | None = None
    phase: StrictStr | None = None

    @classmethod
    def nested_schemas(cls):
        return {"content": _PartKeys}

    def text(self):
        if isinstance(self.content, str):
            return self.content
        return "".join(getattr(part, "text", None) or getattr(part, "refusal", "") for part in self.content)


class FunctionCallItem(Schema):
    """A call an earlier answer made (`response.output` echoed back)."""
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: FunctionName
    arguments: StrictStr
    id: ItemId | None = None
    status: Status | None = None


class FunctionCallOutputItem(Schema):
    """What the caller's function returned for `call_id`."""
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: Union[StrictStr, Annotated[list[InputTextPart], Field(min_length=1)]]
    id: ItemId | None = None
    status: Status | None = None

    def text(self):
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class UnservedItem(Schema):
    """Item kinds this server cannot serve: references to stored items, reasoning, built-in tools' calls."""
    type: Literal["item_reference", "reasoning", "web_search_call", "file_search_call", "computer_call",
                  "computer_call_output", "image_generation_call", "code_interpreter_call", "local_shell_call",
                  "local_shell_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
                  "mcp_approval_response", "custom_tool_call", "custom_tool_call_output"]


Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, UnservedItem]


class _PartKeys(Schema):
    """The keys a content part may hold, for strict mode's unused-field check."""
    type: Any = None
    text: Any = None
    annotations: Any = None
    logprobs: Any = None
    refusal: Any = None


# --- tools and the text format ---


class FunctionToolDef(Schema):
    type: Literal["function"]
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class BuiltInTool(Schema):
    """web_search, file_search, computer_use_preview...: OpenAI's hosted tools (a 400 naming it)."""
    type: StrictStr


class NamedFunction(Schema):
    type: Literal["function"]
    name: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedFunction]


class TextConfig(Schema):
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict"}
    format: dict[str, Any] | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without that control honours


class ReasoningConfig(Schema):
    effort: Literal["none"] | None = None  # no reasoning: only "none" is honoured
    summary: None = None


# The fields this server refuses whatever the mode (they change the answer), with why.
LOGPROBS = "message.output_text.logprobs"  # the one `include` value served
REFUSED = {
    "background": "background responses are not served: send the request and wait, or use a batch",
    "conversation": "conversation objects are not served: chain with previous_response_id",
    "prompt": "stored prompt templates are not served: send the input itself",
}


class ResponseRequest(Schema):
    model: NonEmptyStr
    input: Union[StrictStr, Annotated[list[Item], Field(min_length=1)]]
    instructions: StrictStr | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None  # as this server's chat takes it (OpenAI's Responses API has none)
    metadata: Annotated[dict[Annotated[StrictStr, Field(max_length=METADATA_KEY_MAX)],
                             Annotated[StrictStr, Field(max_length=METADATA_VALUE_MAX)]],
                        Field(max_length=METADATA_MAX_KEYS)] | None = None
    user: StrictStr | None = None
    text: TextConfig | None = None
    tools: list[Union[FunctionToolDef, BuiltInTool]] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    max_tool_calls: PositiveInt | None = None  # an answer makes at most one call here
    previous_response_id: NonEmptyStr | None = None
    store: StrictBool = True
    stream: StrictBool = False
    truncation: Literal["disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    include: list[StrictStr] | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None

    @classmethod
    def nested_schemas(cls):
        return {"input": _ItemKeys, "text": TextConfig, "tools": FunctionToolDef, "reasoning": ReasoningConfig}

    # --- checks (inference_app.schemas.parse_request calls `check_request` after the schema) ---

    def check_request(self, prefix=""):
        for name, reason in REFUSED.items():
            if name in self.model_fields_set and getattr(self, name) not in (False, None):
                raise ApiError(400, "field_not_honoured", f"'{prefix}{name}' cannot be honoured: {reason}",
                               param=prefix + name)
        for index, name in enumerate(self.include or ()):
            if name != LOGPROBS:
                raise ApiError(400, "field_not_honoured", f"Invalid value for '{prefix}include.{index}': {name!r} "
                               f"cannot be included here; only {LOGPROBS!r}", param=f"{prefix}include.{index}")
        for index, tool in enumerate(self.tools or ()):
            if isinstance(tool, BuiltInTool) and tool.type != "function":
                raise ApiError(400, "field_not_honoured",
                               f"Invalid value for '{prefix}tools.{index}.type': the built-in tool {tool.type!r} is not "
                               f"served here; only function tools", param=f"{prefix}tools.{index}.type")
        for index, item in enumerate(self.items()):
            self._check_item(item, f"{prefix}input.{index}")
        try:
            parse_request(CHAT, self.chat_body([]), strict=True)
        except ApiError as error:
            raise renamed(error, prefix) from None

    def _check_item(self, item, path):
        if isinstance(item, UnservedItem):
            raise ApiError(400, "field_not_honoured", f"Invalid value for '{path}.type': {item.type!r} items are not "
                           "served here; send messages, function_call and function_call_output items",
                           param=f"{path}.type")
        if isinstance(item, MessageItem) and not isinstance(item.content, str):
            for number, part in enumerate(item.content):
                param = f"{path}.content.{number}"
                if isinstance(part, UnservedPart):
                    raise ApiError(400, "field_not_honoured", f"Invalid value for '{param}.type': this model reads "
                                   f"text only, not {part.type}", param=f"{param}.type")
                if isinstance(part, (OutputTextPart, RefusalPart)) and item.role != "assistant":
                    raise ApiError(400, "invalid_parameter", f"Invalid value for '{param}.type': {part.type} is an "
                                   f"assistant's part, in a {item.role} message", param=f"{param}.type")

    # --- what it means ---

    def items(self):
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def wants_logprobs(self):
        """`include: ["message.output_text.logprobs"]`: each output token's logprob, and
        `top_logprobs` of the most likely (the chat answer's own, passed on)."""
        return LOGPROBS in (self.include or ())

    def function_tools(self):
        return [tool for tool in self.tools or () if isinstance(tool, FunctionToolDef)]

    def chat_body(self, context):
        """The chat completion request that answers this one, after `context` (the stored
        conversation of `previous_response_id`: a list of item dicts)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        for item in [*context, *(plain(item) for item in self.items())]:
            _add_message(messages, item)
        body = {"model": self.model, "messages": messages, "temperature": self.temperature, "top_p": self.top_p}
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": _response_format(self.text.format) if self.text and self.text.format else None,
        }
        body.update({name: value for name, value in optional.items() if value is not None})
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        tools = self.function_tools()
        if tools:
            body["tools"] = [{"type": "function", "function": _function(tool)} for tool in tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                          "function": {"name": choice.name}}
        return body

    def chat_request(self, context=()):
        """The chat request as the engine runs it (a batch row: no stored context)."""
        return parse_request(CHAT, self.chat_body(list(context)), strict=True)

    def input_items(self):
        """This input as stored items, each with an id (as `input_items` lists them)."""
        return [_with_id(plain(item)) for item in self.items()]

    def is_scoring(self):
        return False


class _ItemKeys(Schema):
    """The keys an input item may hold, for strict mode's unused-field check."""
    type: Any = None
    role: Any = None
    content: Any = None
    id: Any = None
    status: Any = None
    phase: Any = None
    call_id: Any = None
    name: Any = None
    arguments: Any = None
    output: Any = None

    @classmethod
    def nested_schemas(cls):
        return {"content": _PartKeys}


def plain(item):
    """An item as a dict of what was sent (a string message's content as an input_text part)."""
    data = item.model_dump(exclude_none=True)
    if data.get("type") is None and "role" in data:
        data = {"type": "message", **data}
    if data.get("type") == "message" and isinstance(data.get("content"), str):
        kind = "output_text" if data["role"] == "assistant" else "input_text"
        data["content"] = [{"type": kind, "text": data["content"]} | ({"annotations": []} if kind == "output_text" else {})]
    return data


_ITEM_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def _with_id(item):
    item = dict(item)
    item.setdefault("id", new_id(_ITEM_PREFIX[item["type"]]))
    item.setdefault("status", "completed")
    return item


def _add_message(messages, item):
    """Append `item` (a dict) to the chat `messages`: a call joins the assistant turn before it."""
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # one turn: its text, then its calls
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item["output"]
        text = output if isinstance(output, str) else "".join(part.get("text", "") for part in output)
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    else:
        content = item["content"]
        text = content if isinstance(content, str) else "".join(
            part.get("text") or part.get("refusal") or "" for part in content)
        messages.append({"role": item["role"], "content": text})


def _function(tool):
    spec = {"name": tool.name}
    for name in ("description", "parameters", "strict"):
        if getattr(tool, name) is not None:
            spec[name] = getattr(tool, name)
    return spec


def _response_format(format_):
    """`text.format` as chat's `response_format`: json_schema's fields move under `json_schema`."""
    if format_.get("type") != "json_schema":
        return format_
    return {"type": "json_schema", "json_schema": {key: value for key, value in format_.items() if key != "type"}}


# --- refusals, renamed from the chat request's fields to this body's ---

_RENAMES = [
    (re.compile(r"response_format\.json_schema\b"), "text.format"),
    (re.compile(r"response_format\b"), "text.format"),
    (re.compile(r"tools\.(\d+)\.function\b"), r"tools.\1"),
    (re.compile(r"tool_choice\.function\.name\b"), "tool_choice.name"),
    (re.compile(r"max_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"messages(\.\d+)?(\.[a-z_.0-9]+)?"), "input"),
]


def rename(text):
    for pattern, replacement in _RENAMES:
        text = pattern.sub(replacement, text)
    return text


_QUOTED = re.compile(r"'((?:body\.)?(?:response_format|tools|tool_choice|max_completion_tokens|messages)\b[^']*)'")


def renamed(error, prefix=""):
    """The chat route's refusal of the chat request, naming this body's field (`prefix`: where
    the body sits, for an error that names the chat request's own fields)."""
    param = prefix + rename(error.param) if error.param else None
    message = _QUOTED.sub(lambda match: f"'{prefix}{rename(match.group(1))}'", error.message)
    return ApiError(error.status, error.code, message, param=param, error_type=error.type, retry_after=error.retry_after,
                    details=error.details)


def as_json(body):
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))
