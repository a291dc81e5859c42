"""Request schemas for the inference endpoints, shared by the routes and the batch validator.

One `parse_request(endpoint, body, strict)` turns a decoded JSON body into a validated pydantic
object plus the list of fields the endpoint would not use, or raises the ApiError the route
answers (SPEC sections 2 and 4). The batch validator calls the very same function with
strict=True, so a line is refused with exactly the code and message the route would give.

This module imports neither torch nor the engine: web processes use it too.
"""

import functools
import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from millm_lib.errors import ApiError
from millm_lib.ids import MODEL_ID_MAX_LENGTH
from millm_lib.limits import CHAT, COMPLETIONS, EMBEDDINGS, PROBE_SCORE
from inference_app.structured import check_response_format, grammar_kind
from inference_app.tools import call_format, check_tools, field_value

SEED_MAX = 2**32 - 1
# The sampling controls' limits, as OpenAI sets them (SPEC 4a).
LOGIT_BIAS_MAX_ENTRIES = 300
LOGIT_BIAS_LIMIT = 100
PENALTY_LIMIT = 2
N_MAX = 8  # choices in one request

Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
Seed = Annotated[StrictInt, Field(ge=0, le=SEED_MAX)]
TokenId = Annotated[StrictInt, Field(ge=0)]
BiasedTokenId = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,9}$", description="a token id, in decimal")]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]


class Schema(BaseModel):
    # Extra keys are kept, not refused here: they are the "unused fields" that strict mode
    # refuses and non-strict mode reports in X-miLLM-Ignored-Fields.
    model_config = ConfigDict(extra="allow", frozen=True)

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        """As /api/schema/ documents it: fields the server cannot honour take only their neutral
        value (NEUTRAL), any other is 400 field_not_honoured; `dimensions` is refused whatever its
        value."""
        documented = super().__get_pydantic_json_schema__(core_schema, handler)
        properties = handler.resolve_ref_schema(documented).get("properties", {})
        for name, neutral in NEUTRAL.items():
            if name in properties:
                properties[name] = {
                    "anyOf": [{"const": neutral}, {"type": "null"}],
                    "description": f"Only {json.dumps(neutral)}: this server cannot honour another value (field_not_honoured)",
                }
        if "dimensions" in properties:
            properties["dimensions"] = {"type": "null",
                                        "description": "Refused (field_not_honoured): embeddings have the model's own width"}
        return documented

    @classmethod
    def nested_schemas(cls):
        """Keys whose value holds nested schemas: {key: Schema} (a dict, or a list of dicts)."""
        return {}

    def check_request(self, param_prefix):
        """A body's own checks beyond its schema, after the shared ones; none by default."""


class TextPart(Schema):
    type: Literal["text"]
    text: StrictStr


FunctionName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="1 to 64 of a-z, A-Z, 0-9, _ and -")]


class CalledFunction(Schema):
    name: FunctionName
    arguments: StrictStr  # JSON text, as the model wrote it


class AssistantToolCall(Schema):
    """A call an earlier assistant message made, sent back in the conversation."""
    id: NonEmptyStr
    type: Literal["function"]
    function: CalledFunction

    @classmethod
    def nested_schemas(cls):
        return {"function": CalledFunction}


class ChatMessage(Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only on an assistant message with tool_calls (inference_app/tools.py checks)
    content: Union[StrictStr, Annotated[list[TextPart], Field(min_length=1)]] | None = None
    tool_calls: Annotated[list[AssistantToolCall], Field(min_length=1)] | None = None
    tool_call_id: NonEmptyStr | None = None  # a tool message's: the call it answers

    @classmethod
    def nested_schemas(cls):
        return {"content": TextPart, "tool_calls": AssistantToolCall}

    def text(self):
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_role(self):
        # `developer` is OpenAI's newer name for the system role.
        return "system" if self.role == "developer" else self.role


class StreamOptions(Schema):
    include_usage: StrictBool = False


Stop = Union[StrictStr, Annotated[list[NonEmptyStr], Field(min_length=1, max_length=4)]]

# Output-changing fields this server cannot honour, with the value that changes nothing.
# A non-neutral value is refused with field_not_honoured in every mode (SPEC section 4).
NEUTRAL = {
    "echo": False,
    "best_of": 1,
    "suffix": "",
}


class FunctionSpec(Schema):
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, in the structured outputs subset
    strict: StrictBool | None = None


class FunctionTool(Schema):
    type: Literal["function"]
    function: FunctionSpec

    @classmethod
    def nested_schemas(cls):
        return {"function": FunctionSpec}


class ChosenFunction(Schema):
    name: FunctionName


class NamedToolChoice(Schema):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class GenerationRequest(Schema):
    model: NonEmptyStr
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: Stop | None = None
    seed: Seed | None = None
    n: Annotated[StrictInt, Field(ge=1, le=N_MAX)] = 1  # choices, sharing one prefill (SPEC 4a)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=1024)] | None = None
    # The sampling controls (inference_app/engine/controls.py): token id (as a string) to a bias.
    logit_bias: Annotated[dict[BiasedTokenId, Bias], Field(max_length=LOGIT_BIAS_MAX_ENTRIES)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # text, json_object or json_schema (inference_app/structured.py checks the schema's subset).
    response_format: dict[str, Any] | None = None

    @classmethod
    def nested_schemas(cls):
        return {"stream_options": StreamOptions}

    def stop_sequences(self):
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) and self.stop else list(self.stop or [])

    def include_usage(self):
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    # Function tools (inference_app/tools.py): rendered by the template, a forced call decoded
    # under its parameters' grammar. One call per answer: parallel_tool_calls is read, not needed.
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @classmethod
    def nested_schemas(cls):
        return {"messages": ChatMessage, "stream_options": StreamOptions, "tools": FunctionTool}

    def requested_max_tokens(self):
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def is_scoring(self):
        """Scoring mode (SPEC 4): allowed_token_ids, or logprobs with max_tokens 1. logprobs with
        any other max_tokens (or none) generates, each token with its logprobs."""
        return self.allowed_token_ids is not None or (self.logprobs and self.requested_max_tokens() == 1)

    def generated_logprobs(self):
        """How many top logprobs each generated token reports (0 and up), or None: not asked."""
        return (self.top_logprobs or 0) if self.logprobs and not self.is_scoring() else None


GENERATED_LOGPROBS_MAX = 5  # completions' logprobs on generated tokens, as OpenAI limits them


class CompletionRequest(GenerationRequest):
    prompt: Union[StrictStr, Annotated[list[StrictStr], Field(min_length=1)]]
    max_tokens: PositiveInt | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def prompts(self):
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def requested_max_tokens(self):
        return self.max_tokens

    def is_scoring(self):
        """Scoring mode (SPEC 4): allowed_token_ids, or logprobs with max_tokens 1."""
        return self.allowed_token_ids is not None or (self.logprobs is not None and self.max_tokens == 1)

    def generated_logprobs(self):
        return self.logprobs if self.logprobs is not None and not self.is_scoring() else None


class EmbeddingRequest(Schema):
    model: NonEmptyStr
    input: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)]]
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["mean", "last", "cls"] = "mean"
    normalize: StrictBool = False
    dimensions: Any = None

    def inputs(self):
        return [self.input] if isinstance(self.input, str) else list(self.input)


class ManagementSchema(BaseModel):
    """Management bodies (/api): unknown keys are refused, naming them."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ProbeInput(ManagementSchema):
    text: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    prompt_tokens: Annotated[StrictInt, Field(ge=0)] | None = None

    def kind(self):
        return next(name for name in ("text", "messages", "token_ids") if getattr(self, name) is not None)


class ProbeScoreRequest(ManagementSchema):
    probe_ids: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    inputs: Annotated[list[ProbeInput], Field(min_length=1)]
    windows: Annotated[list[Literal["all", "prompt", "response"]], Field(min_length=1)] = ["all"]
    return_token_ids: StrictBool = False


class ProbeImport(ManagementSchema):
    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    model: NonEmptyStr
    layer: Annotated[StrictInt, Field(ge=0)]
    weights: Annotated[list[Annotated[float, Field(allow_inf_nan=False)]], Field(min_length=1)]
    bias: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    norm_mean: Union[Annotated[float, Field(allow_inf_nan=False)], list[Annotated[float, Field(allow_inf_nan=False)]]] = 0.0
    norm_std: Union[Annotated[float, Field(gt=0, allow_inf_nan=False)], list[Annotated[float, Field(gt=0, allow_inf_nan=False)]]] = 1.0
    aggregation: Literal["mean", "max", "last"]
    threshold: Annotated[float, Field(allow_inf_nan=False)] | None = None


class LeaseRequest(ManagementSchema):
    holder: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    reason: Annotated[StrictStr, Field(min_length=1, max_length=512)]
    ttl_seconds: Annotated[StrictInt, Field(ge=1, le=7200)] = 7200


class ModelRegistration(ManagementSchema):
    source: NonEmptyStr
    id: Annotated[StrictStr, Field(min_length=1, max_length=MODEL_ID_MAX_LENGTH)] | None = None
    # A well-known template's name or a Jinja file's path, over the model's own (MILLM_CHAT_TEMPLATE's values).
    chat_template: Annotated[StrictStr, Field(min_length=1, max_length=1024)] | None = None


class LoadRequest(ManagementSchema):
    engine: NonEmptyStr | None = None


SCHEMAS = {
    CHAT: ChatCompletionRequest,
    COMPLETIONS: CompletionRequest,
    EMBEDDINGS: EmbeddingRequest,
}


def register_schema(endpoint, schema):
    """Another app's endpoint parsed by `parse_request` (responses_app registers /v1/responses at
    ready): its schema may define `check_request(param_prefix)`, called after the common checks."""
    SCHEMAS[endpoint] = schema
    _union_tags.cache_clear()


@dataclass(frozen=True)
class ParsedRequest:
    endpoint: str
    request: Schema
    ignored: list[str] = field(default_factory=list)


def parse_strict_header(value):
    """X-miLLM-Strict: true|1|false|0, case-insensitive; absent means the server default."""
    if value is None:
        return settings.MILLM_STRICT_DEFAULT
    lowered = value.strip().lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise ApiError(
        400,
        "invalid_parameter",
        f"Invalid value for 'X-miLLM-Strict': expected true, 1, false or 0, got {value!r}",
        param="X-miLLM-Strict",
    )


def parse_request(endpoint, body, strict, param_prefix=""):
    """Validate one request body for `endpoint`.

    1. The body must be a JSON object; JSON nulls mean "not sent" and are dropped.
    2. Schema errors: 400 invalid_parameter naming the dotted path of the first.
    3. Output-changing fields with a non-neutral value: 400 field_not_honoured.
    4. Fields the endpoint would not use: refused in strict mode, else reported.
    """
    if endpoint == PROBE_SCORE:
        request = parse_management(ProbeScoreRequest, body, "invalid_probe_score_request", param_prefix)
        _check_probe_score(request, param_prefix)
        return ParsedRequest(endpoint, request, [])
    schema = SCHEMAS[endpoint]
    if not isinstance(body, dict):
        raise ApiError(
            400,
            "invalid_parameter",
            f"Invalid value for '{param_prefix.rstrip('.') or 'body'}': the request body must be a JSON object, "
            f"got {_json_type(body)}",
            param=param_prefix.rstrip(".") or None,
        )
    body = _drop_nulls(body)
    try:
        request = schema.model_validate(body)
    except ValidationError as error:
        raise _invalid_parameter(error, param_prefix) from None
    _check_honoured(request, endpoint, param_prefix)
    if field_value(request, "response_format") is not None:
        check_response_format(request.response_format, param_prefix + "response_format")
    if isinstance(request, ChatCompletionRequest):
        check_tools(request, param_prefix)
    _check_scoring(request, param_prefix)
    _check_consistency(request, param_prefix)
    request.check_request(param_prefix)
    unused = _unused_fields(schema, body, [])
    if unused and strict:
        first = ".".join(str(part) for part in unused[0])
        listed = ", ".join(_bracket_path(path) for path in unused)
        raise ApiError(
            400,
            "unused_fields_refused",
            f"Strict mode refuses fields this endpoint does not use: {listed}",
            param=param_prefix + first,
        )
    return ParsedRequest(endpoint, request, [_bracket_path(path) for path in unused])


def parse_management(schema, body, code, param_prefix=""):
    """Validate a management body; errors are `code` naming the dotted field."""
    if not isinstance(body, dict):
        raise ApiError(400, code, f"The body must be a JSON object, got {_json_type(body)}", details={"field": None})
    try:
        return schema.model_validate(_drop_nulls(body))
    except ValidationError as error:
        invalid = _invalid_parameter(error, param_prefix)
        raise ApiError(400, code, invalid.message, param=invalid.param, details={"field": invalid.param}) from None


def _check_probe_score(request, param_prefix):
    code = "invalid_probe_score_request"
    limits = (
        ("inputs", len(request.inputs), settings.PROBE_SCORE_MAX_INPUTS, "PROBE_SCORE_MAX_INPUTS"),
        ("probe_ids", len(request.probe_ids or ()), settings.PROBE_SCORE_MAX_PROBES, "PROBE_SCORE_MAX_PROBES"),
    )
    for name, count, limit, setting in limits:
        if count > limit:
            param = param_prefix + name
            raise ApiError(
                400, code, f"Invalid value for '{param}': {count} items, over the limit of {limit} ({setting})",
                param=param, details={"field": param},
            )
    for index, item in enumerate(request.inputs):
        given = [name for name in ("text", "messages", "token_ids") if getattr(item, name) is not None]
        param = f"{param_prefix}inputs.{index}"
        if len(given) != 1:
            raise ApiError(
                400, code,
                f"Invalid value for '{param}': send exactly one of text, messages or token_ids, got "
                f"{', '.join(given) or 'none'}",
                param=param, details={"field": param},
            )
        if item.prompt_tokens is not None and item.token_ids is None:
            raise ApiError(
                400, code, f"Invalid value for '{param}.prompt_tokens': prompt_tokens goes with token_ids",
                param=f"{param}.prompt_tokens", details={"field": f"{param}.prompt_tokens"},
            )
        if item.token_ids is not None and (item.prompt_tokens or 0) > len(item.token_ids):
            raise ApiError(
                400, code,
                f"Invalid value for '{param}.prompt_tokens': {item.prompt_tokens} is more than the "
                f"{len(item.token_ids)} token_ids",
                param=f"{param}.prompt_tokens", details={"field": f"{param}.prompt_tokens"},
            )


def _json_type(value):
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _drop_nulls(value):
    if isinstance(value, dict):
        return {key: _drop_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_drop_nulls(item) for item in value]
    return value


def _invalid_parameter(error, param_prefix):
    # A union reports one error per member, tagged with the member's type name ("str",
    # "list[TextPart]"). Drop the tags, then drop a member's error at a path that another
    # member's deeper error explains (content=[{"type": "x"}] is a bad part, not "not a string").
    issues = []
    for item in error.errors(include_url=False):
        path, tagged = _strip_union_tags(item["loc"])
        issues.append((path, tagged, _reason(item)))
    tagged_paths = [path for path, tagged, _ in issues if tagged]
    kept = {}
    for path, tagged, reason in issues:
        if tagged and any(len(other) > len(path) and other[: len(path)] == path for other in tagged_paths):
            continue
        kept.setdefault(path, []).append(reason)
    paths = sorted(kept, key=len, reverse=True) if len(kept) > 1 else list(kept)
    first = paths[0]
    param = param_prefix + ".".join(str(part) for part in first)
    reason = " or ".join(dict.fromkeys(kept[first]))
    message = f"Invalid value for '{param}': {reason}"
    if len(paths) > 1:
        message += f" (and {len(paths) - 1} more validation errors)"
    return ApiError(400, "invalid_parameter", message, param=param)


def _strip_union_tags(loc):
    path, tagged = [], False
    for part in loc:
        if isinstance(part, str) and part.isdigit():  # a dict's key (logit_bias's token ids), never a tag
            path.append(part)
            continue
        if isinstance(part, str) and not part.isidentifier():
            tagged = True  # "list[TextPart]", "function-after[...]"
            continue
        if isinstance(part, str) and part in _union_tags():
            tagged = True
            continue
        path.append(part)
    return tuple(path), tagged


@functools.cache
def _union_tags():
    """The names pydantic tags a union member's errors with: builtins and our schemas' classes."""
    names, pending = {"str", "int", "float", "bool", "list", "dict"}, [Schema]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return frozenset(names)


def _reason(item):
    reason = item["msg"]
    if item["type"] == "missing":
        return "this field is required"
    if item["type"] == "extra_forbidden":
        return "unknown field"
    if item["type"] == "literal_error" or item["type"].startswith(("string_", "int_", "float_", "bool_", "list_")):
        if "input" in item and not isinstance(item["input"], (dict, list)):
            reason += f", got {json.dumps(item['input'])[:80]}"
    return reason


def _check_honoured(request, endpoint, param_prefix):
    sent = request.model_fields_set
    for name, neutral in NEUTRAL.items():
        if name not in sent or name not in type(request).model_fields:
            continue
        value = getattr(request, name)
        if value == neutral or (name == "suffix" and value == ""):
            continue
        raise ApiError(
            400,
            "field_not_honoured",
            f"'{name}' = {json.dumps(value)[:200]} cannot be honoured by this server; "
            f"send {json.dumps(neutral)} or leave it out",
            param=param_prefix + name,
        )
    if endpoint == EMBEDDINGS and "dimensions" in sent:
        raise ApiError(
            400,
            "field_not_honoured",
            f"'dimensions' = {json.dumps(request.dimensions)[:80]} cannot be honoured: embeddings have the "
            "model's own width; leave it out",
            param=param_prefix + "dimensions",
        )


def _check_scoring(request, param_prefix):
    """Scoring mode (SPEC 4): one forward pass, so one token, one choice, no stream."""
    if not isinstance(request, (ChatCompletionRequest, CompletionRequest)) or not request.is_scoring():
        return
    max_name = "max_tokens"
    if isinstance(request, ChatCompletionRequest) and request.max_tokens is None:
        max_name = "max_completion_tokens"
    wanted = request.requested_max_tokens()
    if wanted != 1:
        got = "nothing" if wanted is None else str(wanted)
        raise _scoring_error(param_prefix + max_name, f"scoring mode needs an explicit {max_name} of 1, got {got}")
    if request.stream:
        raise _scoring_error(param_prefix + "stream", "scoring mode cannot stream")
    if request.n != 1:
        raise _scoring_error(param_prefix + "n", f"scoring mode gives one choice, got n = {request.n}")
    # These shape generated tokens; scoring reports the model's own distribution at one position.
    shaping = {"logit_bias": bool(request.logit_bias), "presence_penalty": bool(request.presence_penalty),
               "frequency_penalty": bool(request.frequency_penalty),
               "response_format": grammar_kind(request.response_format) is not None,
               "tool_choice": call_format(request) is not None}
    refused = [name for name, sent in shaping.items() if sent]
    if refused:
        raise ApiError(400, "field_not_honoured",
                       f"'{refused[0]}' cannot be honoured in scoring mode (logprobs or allowed_token_ids with "
                       f"{max_name} 1), which reports the model's own distribution; leave it out",
                       param=param_prefix + refused[0])
    if 0 < request.temperature < 0.001:
        raise _scoring_error(
            param_prefix + "temperature", f"scoring mode needs temperature 0 or at least 0.001, got {request.temperature}"
        )


def _scoring_error(param, reason):
    return ApiError(400, "invalid_parameter", f"Invalid value for '{param}': {reason}", param=param)


def _check_consistency(request, param_prefix):
    if isinstance(request, ChatCompletionRequest):
        if (
            request.max_tokens is not None
            and request.max_completion_tokens is not None
            and request.max_tokens != request.max_completion_tokens
        ):
            param = param_prefix + "max_completion_tokens"
            raise ApiError(
                400,
                "invalid_parameter",
                f"Invalid value for '{param}': {request.max_completion_tokens} differs from max_tokens "
                f"{request.max_tokens}; send one of them",
                param=param,
            )
        if request.top_logprobs is not None and not request.logprobs:
            param = param_prefix + "top_logprobs"
            raise ApiError(
                400,
                "invalid_parameter",
                f"Invalid value for '{param}': top_logprobs needs logprobs: true",
                param=param,
            )
    generating = isinstance(request, CompletionRequest) and request.generated_logprobs() is not None
    if generating and request.logprobs > GENERATED_LOGPROBS_MAX:
        param = param_prefix + "logprobs"
        raise ApiError(
            400,
            "invalid_parameter",
            f"Invalid value for '{param}': logprobs on generated tokens (max_tokens other than 1) is from 0 to "
            f"{GENERATED_LOGPROBS_MAX}, got {request.logprobs}; scoring mode (max_tokens 1) takes up to 20",
            param=param,
        )
    if isinstance(request, CompletionRequest) and request.stream and len(request.prompts()) > 1:
        param = param_prefix + "prompt"
        raise ApiError(
            400,
            "invalid_parameter",
            f"Invalid value for '{param}': a streamed completion takes one prompt, got {len(request.prompts())}",
            param=param,
        )
    if isinstance(request, EmbeddingRequest) and len(request.inputs()) > settings.EMBEDDINGS_MAX_INPUTS:
        param = param_prefix + "input"
        raise ApiError(
            400,
            "invalid_parameter",
            f"Invalid value for '{param}': {len(request.inputs())} inputs, over the limit of "
            f"{settings.EMBEDDINGS_MAX_INPUTS} (EMBEDDINGS_MAX_INPUTS)",
            param=param,
        )


@functools.cache
def _field_names(schema):
    # Read once: pydantic's `model_fields` goes through a slow descriptor on every access.
    return frozenset(schema.model_fields)


def _unused_fields(schema, data, prefix):
    """Paths of the keys `schema` does not use, in request order."""
    unused = []
    nested = schema.nested_schemas()
    for key, value in data.items():
        if key not in _field_names(schema):
            unused.append((*prefix, key))
            continue
        child = nested.get(key)
        if child is None:
            continue
        if isinstance(value, dict):
            unused.extend(_unused_fields(child, value, [*prefix, key]))
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, dict):
                    unused.extend(_unused_fields(child, item, [*prefix, key, index]))
    return unused


def _bracket_path(path):
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text
