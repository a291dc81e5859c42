"""Function tools on chat (issue 29, point 3, SPEC 4a): what a request's `tools` and
`tool_choice` mean for its prompt, its grammar and its answer. Pure text and JSON: the web
process checks requests with it and the engine (services.py) shapes answers with it.

- **The prompt.** A chat template that reads `tools` (as transformers' `apply_chat_template(tools=...)`
  passes them) renders them itself. For one that does not, such as SmolLM2's, the tools are
  described in the system message in the Hermes form many open models are trained on: calls
  inside `<tool_call>` tags, results inside `<tool_response>` tags. `tool_choice: "none"`
  renders no tools.
- **The grammar.** `required` or a named function forces a call: the answer is decoded under
  the JSON schema of `{"name": <a chosen function>, "arguments": <its parameters>}`
  (`call_format`), so even a random model makes a valid call. `auto` decodes freely, and an
  answer that is one or more `<tool_call>` blocks naming declared functions is read as calls.
- **The answer.** `message.tool_calls` (`id`, `type: function`, `function.name`,
  `function.arguments` as JSON text) with `finish_reason: "tool_calls"`; streamed as OpenAI
  streams them (`CallStream`).

This module imports neither torch nor the engine.
"""

import json
import re

from millm_lib.errors import invalid_value
from millm_lib.ids import new_id
from inference_app.structured import check_schema

TOOLS_MAX = 128  # OpenAI's limit of tools in one request
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# A forced call, as its grammar writes it (no whitespace between tokens): the arguments follow this head.
_FORCED_HEAD = re.compile(r'\{"name": ?"([a-zA-Z0-9_-]{1,64})", ?"arguments": ?')
_AUTO_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


# --- the request ---


def check_tools(request, prefix=""):
    """Refuse tools, a tool choice or tool messages that cannot be served, naming the field."""
    tools = request.tools or []
    if len(tools) > TOOLS_MAX:
        raise invalid_value(f"{prefix}tools", f"{len(tools)} tools, over the limit of {TOOLS_MAX}")
    names = set()
    for index, tool in enumerate(tools):
        function = tool.function
        if function.name in names:
            raise invalid_value(f"{prefix}tools.{index}.function.name", f"the name {function.name!r} is used by two tools")
        names.add(function.name)
        if function.parameters is not None:
            check_schema(function.parameters, f"{prefix}tools.{index}.function.parameters", bool(function.strict))
    choice = request.tool_choice
    if choice not in (None, "none") and not tools:
        raise invalid_value(f"{prefix}tool_choice", f"{json.dumps(_plain(choice))[:80]} needs at least one tool in 'tools'")
    named = forced_name(choice)
    if named is not None and named not in names:
        raise invalid_value(f"{prefix}tool_choice.function.name", f"{named!r} is not one of the tools ({', '.join(sorted(names))})")
    for index, message in enumerate(request.messages):
        _check_message(message, f"{prefix}messages.{index}")


def _check_message(message, path):
    if message.role == "tool" and not message.tool_call_id:
        raise invalid_value(f"{path}.tool_call_id", "a tool message names the call it answers (tool_call_id)")
    if message.tool_calls and message.role != "assistant":
        raise invalid_value(f"{path}.tool_calls", f"only an assistant message carries tool_calls, not a {message.role} message")
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise invalid_value(f"{path}.content", "content is required, except on an assistant message with tool_calls")


def field_value(request, name):
    """The value of a request body's field `name`, or None where its kind of body has no such
    field (pydantic keeps a model's field values in its `__dict__`). A getattr with a default
    costs a raised and caught error in pydantic's fallback for extra keys: 8 µs a miss, five
    misses a completions line, about two fifths of its validation (98 µs a line, then 55 µs)."""
    return vars(request).get(name)


def forced_name(choice):
    """The function a named tool choice forces, or None."""
    function = getattr(choice, "function", None)
    return function.name if function is not None else None


def renders_tools(request):
    """The tools the prompt shows the model: none under tool_choice "none"."""
    return list(request.tools or []) if field_value(request, "tool_choice") != "none" else []


def call_format(request):
    """The response_format a forced call is decoded under (`required`, or a named function), or
    None: an object `{"name": <const>, "arguments": <the function's parameters>}`, one per
    function the choice allows (anyOf). Each function's `$defs` move to the root, renamed
    `<function>.<definition>`, so its `$ref`s still resolve."""
    choice, tools = field_value(request, "tool_choice"), field_value(request, "tools")
    if not tools or choice in (None, "none", "auto"):
        return None
    named = forced_name(choice)
    definitions, variants = {}, []
    for function in (tool.function for tool in tools if named in (None, tool.function.name)):
        arguments = _rebased(function.parameters or {"type": "object"}, function.name, definitions)
        variants.append({"type": "object", "properties": {"name": {"const": function.name}, "arguments": arguments},
                         "required": ["name", "arguments"], "additionalProperties": False})
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if definitions:
        schema = {**schema, "$defs": definitions}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema, "strict": True}}


def _rebased(parameters, name, definitions):
    local = {key: value for key, value in parameters.items() if key not in ("$defs", "definitions")}
    for key in ("$defs", "definitions"):
        for definition, schema in (parameters.get(key) or {}).items():
            definitions[f"{name}.{definition}"] = _refs_rebased(schema, name)
    rebased = _refs_rebased(local, name)
    if '"$ref": "#"' in json.dumps(parameters):  # the parameters refer to themselves
        definitions[name] = rebased
    return rebased


def _refs_rebased(node, name):
    if isinstance(node, list):
        return [_refs_rebased(item, name) for item in node]
    if not isinstance(node, dict):
        return node
    rebased = {key: _refs_rebased(value, name) for key, value in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref == "#":
            rebased["$ref"] = f"#/$defs/{name}"
        for root in ("#/$defs/", "#/definitions/"):
            if ref.startswith(root):
                rebased["$ref"] = f"#/$defs/{name}.{ref.removeprefix(root)}"
    return rebased


def decoding_format(request):
    """(format, field): what a request's answer is decoded under and the field it comes from: a
    forced call's format ("tools"), else its response_format (None for text)."""
    forced = call_format(request)
    if forced is not None:
        return forced, "tools"
    return field_value(request, "response_format"), "response_format"


# --- the prompt ---


def conversation(messages, tools, native):
    """The messages as the chat template takes them. `native`: the template renders `tools`
    itself (they are passed to it); otherwise they are described in the system message and calls
    and results are written in the Hermes tags."""
    rendered = []
    for message in messages:
        role, content = message.template_role(), message.text()
        if native:
            item = {"role": role, "content": content}
            if message.tool_calls:
                item["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": _json_or_text(call.function.arguments)}}
                    for call in message.tool_calls]
            if message.tool_call_id:
                item["tool_call_id"] = message.tool_call_id
        elif message.role == "tool":
            item = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        else:
            calls = [f'{CALL_OPEN}\n{{"name": {json.dumps(call.function.name)}, "arguments": {call.function.arguments}}}\n'
                     f"{CALL_CLOSE}" for call in message.tool_calls or ()]
            item = {"role": role, "content": "\n".join(filter(None, [content, *calls]))}
        rendered.append(item)
    if tools and not native:
        described = describe(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{described}"}
        else:
            rendered.insert(0, {"role": "system", "content": described})
    return rendered


def describe(tools):
    """The tools as a system message describes them to a model whose template cannot."""
    signatures = "\n".join(json.dumps(template_tool(tool)) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CALL_CLOSE)


def template_tool(tool):
    """A tool as chat templates read it (OpenAI's form, without unset keys)."""
    return {"type": "function", "function": tool.function.model_dump(exclude_none=True)}


def _json_or_text(arguments):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# --- the answer ---


def read_calls(request, text):
    """(content, calls) of an answer: a forced call's JSON (its arguments as far as they go, if
    cut off), or under `auto` the `<tool_call>` blocks that name declared functions. calls are
    [(name, arguments text)]; an answer with no call is content."""
    if call_format(request) is not None:
        head = _FORCED_HEAD.match(text)
        if head is None:
            return text, []
        return None, [(head.group(1), text[head.end():len(text) - _closing(text)])]
    declared = {tool.function.name for tool in renders_tools(request)}
    if not declared or CALL_OPEN not in text:
        return text, []
    calls = []
    for block in _AUTO_CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or call.get("name") not in declared or not isinstance(call.get("arguments"), dict):
            return text, []
        calls.append((call["name"], json.dumps(call["arguments"])))
    content = text[: text.index(CALL_OPEN)].strip() or None
    return (content, calls) if calls else (text, [])


def tool_calls(calls):
    """The answer's `tool_calls`, each with a fresh id."""
    return [{"id": new_id("call_"), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls]


class CallStream:
    """A streamed answer's deltas, as OpenAI streams them: text as `content`, or once a call is
    known, `tool_calls` deltas (the first with the call's index, id, type and name, then the
    arguments in pieces). `feed(text)` and `finish()` return lists of deltas; `called` says
    whether the answer was a call (its finish reason is then "tool_calls").

    A forced call streams its arguments as they are decoded, holding back the one character that
    may be the call's closing brace. Under `auto`, text that may still become `<tool_call>` is
    held back, and a call is sent whole once its block closes (its JSON must be read first)."""

    def __init__(self, request):
        self.request = request
        self.forced = call_format(request) is not None
        self.auto = not self.forced and bool(renders_tools(request))
        self.text = ""
        self.sent = 0  # characters of `text` already sent (as content or arguments)
        self.head = None  # a forced call's head, once decoded
        self.called = False

    def feed(self, delta):
        self.text += delta
        if self.forced:
            return self._forced()
        if self.auto:
            return self._auto(final=False)
        self.sent = len(self.text)
        return [{"content": delta}] if delta else []

    def finish(self):
        if self.forced:
            return self._forced(final=True)
        if self.auto:
            return self._auto(final=True)
        return []

    def _forced(self, final=False):
        deltas = []
        if self.head is None:
            self.head = _FORCED_HEAD.match(self.text)
            if self.head is None:  # cut off before the function's name was whole: text
                return self._content(len(self.text) - self.sent) if final else []
            self.called = True
            self.sent = self.head.end()
            deltas.append({"tool_calls": [{"index": 0, "id": new_id("call_"), "type": "function",
                                           "function": {"name": self.head.group(1), "arguments": ""}}]})
        # The last character may be the call's own closing brace: held back until the end shows it.
        end = len(self.text) - (1 if not final else _closing(self.text))
        if end > self.sent:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": self.text[self.sent:end]}}]})
            self.sent = end
        return deltas

    def _auto(self, final):
        pending = self.text[self.sent:]
        if not self.called:
            start = pending.find(CALL_OPEN)
            if start < 0:
                # Send what cannot be the start of a call tag; hold back a partial tag at the end.
                return self._content(len(pending) - (0 if final else _partial_tag(pending)))
            self.called = True  # from the tag on, the answer is held until it ends
            return self._content(start) + (self._auto(final) if final else [])
        if not final:
            return []
        _, calls = read_calls(self.request, pending)
        if not calls:  # no call after all: what was held is text
            self.called = False
            return self._content(len(pending))
        self.sent = len(self.text)
        return [{"tool_calls": [{"index": index, **call}]} for index, call in enumerate(tool_calls(calls))]

    def _content(self, length):
        if length <= 0:
            return []
        piece = self.text[self.sent:self.sent + length]
        self.sent += length
        return [{"content": piece}]


def _partial_tag(text):
    """How many characters at the end of `text` could begin `<tool_call>`."""
    for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


def _closing(text):
    """1 when a forced call's text is whole (its last character closes the call), else 0: a call
    cut off at max_tokens keeps all it has, as OpenAI sends it (finish_reason "length")."""
    return 1 if text.endswith("}") and _is_json(text) else 0


def _is_json(text):
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _plain(value):
    return value.model_dump() if hasattr(value, "model_dump") else value
