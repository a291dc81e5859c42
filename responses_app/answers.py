"""A chat completion's answer as a `response` object, whole (`response_object`) or as the
Responses API's stream of events (`EventStream`), as the openai SDK types them. Pure: no
database, no torch; the route (views.py) and the batch runner (batches_app.chunks) build with it.
"""

import time

from millm_lib.ids import new_id
from responses_app.shapes import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    MessageOutput,
    OutputText,
    OutputTokensDetails,
    Response,
    ResponseError,
    ResponseUsage,
)


def settings_echo(request, store=None):
    """The request's settings, as every response object (and each stream event's) repeats them;
    `store`: whether it is kept, where that is not the request's own `store` (a batch row)."""
    format_ = request.text.format if request.text and request.text.format else {"type": "text"}
    return {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "metadata": dict(request.metadata or {}),
        "parallel_tool_calls": request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
        "previous_response_id": request.previous_response_id,
        "store": request.store if store is None else store,
        "temperature": request.temperature,
        "text": {"format": format_},
        "tool_choice": _tool_choice(request.tool_choice),
        "tools": [_tool(tool) for tool in request.function_tools()],
        "top_p": request.top_p,
        "truncation": "disabled",
        "user": request.user,
    }


def _tool_choice(choice):
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}


def _tool(tool):
    return {"type": "function", "name": tool.name, "description": tool.description,
            "parameters": tool.parameters, "strict": tool.strict}


def response_object(request, response_id, model, output, usage, finish_reason, created_at, error=None, store=None):
    """The `response` object: `output` items; `usage` as chat counts it (prompt and completion
    tokens); `finish_reason` chat's, or None while in progress."""
    if error is not None:
        status, incomplete = "failed", None
    elif finish_reason is None:
        status, incomplete = "in_progress", None
    elif finish_reason == "length":
        status, incomplete = "incomplete", IncompleteDetails(reason="max_output_tokens")
    else:
        status, incomplete = "completed", None
    return Response(
        id=response_id,
        object="response",
        created_at=created_at,
        completed_at=int(time.time()) if status in ("completed", "incomplete") else None,
        status=status,
        error=error,
        incomplete_details=incomplete,
        model=model,
        output=output,
        usage=_usage(usage) if usage is not None else None,
        background=False,
        reasoning={"effort": None, "summary": None},
        service_tier="default",
        **settings_echo(request, store),
    )


def _usage(usage):
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return ResponseUsage(
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
        output_tokens=completion,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
        total_tokens=prompt + completion,
    )


def message_item(item_id, text, status="completed", logprobs=()):
    return MessageOutput(type="message", id=item_id, status=status, role="assistant",
                         content=[OutputText(type="output_text", text=text, annotations=[], logprobs=list(logprobs))])


def call_item(item_id, call_id, name, arguments, status="completed"):
    return FunctionCallOutput(type="function_call", id=item_id, call_id=call_id, name=name, arguments=arguments,
                              status=status)


def from_chat(request, response_id, chat, created_at, store=None):
    """The response object of a chat completion (`chat`: its body) that answered `request`."""
    choice = chat["choices"][0]
    message, finish_reason = choice["message"], choice["finish_reason"]
    calls = message.get("tool_calls") or []
    status = "incomplete" if finish_reason == "length" else "completed"
    output = []
    if message["content"] is not None and (message["content"] or not calls):
        logprobs = (choice.get("logprobs") or {}).get("content") or ()
        output.append(message_item(new_id("msg_"), message["content"], status, logprobs))
    for call in calls:
        output.append(call_item(new_id("fc_"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return response_object(request, response_id, chat["model"], output, chat["usage"], finish_reason, created_at,
                           store=store)


class EventStream:
    """The Responses API's events for one streamed answer, from the chat chunks that make it:
    `start()`, then `feed(chunk)` for each chunk, then `finish()` (or `fail(error)`). Each event
    carries its `sequence_number`; `response` is the object as it stands."""

    def __init__(self, request, response_id, model):
        self.request, self.response_id, self.model = request, response_id, model
        self.created_at = int(time.time())
        self.sequence = 0
        self.output = []  # items, as they grow
        self.text = None  # the open message item's index, or None
        self.calls = {}  # a chat tool call's index -> its item's index
        self.usage = None
        self.finish_reason = None
        self.response = None

    def _event(self, kind, **fields):
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _snapshot(self, finish_reason=None, error=None):
        # The output as it stands now: an event holds its own list, not the one that keeps growing.
        self.response = response_object(self.request, self.response_id, self.model, list(self.output), self.usage,
                                         finish_reason, self.created_at, error)
        return self.response

    def start(self):
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def feed(self, chunk):
        events = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"], (choice.get("logprobs") or {}).get("content") or [])
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, piece, logprobs):
        events = []
        if self.text is None:
            events += self._open_message()
        item = self.output[self.text]
        item["content"][0]["text"] += piece
        item["content"][0]["logprobs"] += logprobs
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self.text,
                                  content_index=0, delta=piece, logprobs=logprobs))
        return events

    def _open_message(self):
        self.text = len(self.output)
        item = message_item(new_id("msg_"), "", "in_progress")
        self.output.append(item)
        part = OutputText(type="output_text", text="", annotations=[], logprobs=[])
        return [self._event("response.output_item.added", output_index=self.text, item={**item, "content": []}),
                self._event("response.content_part.added", item_id=item["id"], output_index=self.text,
                            content_index=0, part=part)]

    def _call(self, call):
        events = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        if index not in self.calls:
            events += self._close_message()
            self.calls[index] = len(self.output)
            item = call_item(new_id("fc_"), call["id"], function.get("name", ""), "", "in_progress")
            self.output.append(item)
            events.append(self._event("response.output_item.added", output_index=self.calls[index], item=dict(item)))
        position = self.calls[index]
        item = self.output[position]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=position, delta=function["arguments"]))
        return events

    def _close_message(self):
        if self.text is None:
            return []
        position, self.text = self.text, None
        item = self.output[position]
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        part = item["content"][0]
        return [self._event("response.output_text.done", item_id=item["id"], output_index=position,
                            content_index=0, text=part["text"], logprobs=part["logprobs"]),
                self._event("response.content_part.done", item_id=item["id"], output_index=position,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=position, item=item)]

    def finish(self):
        """The closing events: every open item done, then response.completed (or .incomplete)."""
        events = []
        if not self.output:  # an empty answer is an empty message, as a whole response has it
            events += self._open_message()
        events += self._close_message()
        for position in self.calls.values():
            item = self.output[position]
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=position, name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=position, item=item))
        final = self._snapshot(self.finish_reason or "stop")
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=final)]

    def fail(self, error):
        """A failure after the stream began: response.failed naming the error, with one of the
        codes the Responses API defines (this server's own code leads the message)."""
        code = "rate_limit_exceeded" if error.status == 429 else "server_error" if error.status >= 500 else "invalid_prompt"
        failed = self._snapshot(error=ResponseError(code=code, message=f"{error.code}: {error.message}"))
        return [self._event("response.failed", response=failed)]
