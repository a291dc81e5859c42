"""`/v1/responses` as a batch endpoint (issue 30, point 4): what the batch runner runs for a row
and what it records. A row runs as the chat request it is (one at a time, or seated under
batched decoding, `text.format` rows under their grammar) and its output line's `body` is the
response object.

Choices, as OpenAI's documentation makes them for its own batches: a row is stored as a response
only when it says `store: true` (a batch's results are its output file); and a row cannot name
`previous_response_id` (its conversation is its own input items: a stored response could be
deleted between validation and the row's run).
"""

import time

from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from millm_lib.limits import RESPONSES
from responses_app.answers import from_chat


def check_row(parsed, prefix="body."):
    """What a batch row of /v1/responses may not ask, as the line's refusal."""
    if parsed.endpoint == RESPONSES and parsed.request.previous_response_id is not None:
        param = f"{prefix}previous_response_id"
        raise ApiError(400, "invalid_parameter", f"Invalid value for '{param}': a batch row cannot continue a stored "
                       "response; send the conversation as its input items", param=param)


def engine_request(parsed):
    """What the engine runs for a parsed row: a /v1/responses row's chat request; any other row
    as it is."""
    if parsed.endpoint != RESPONSES:
        return parsed
    return parsed.request.chat_request()


def stored_by_row(request):
    """A row's response is stored only when the row asks (`store: true`)."""
    return "store" in request.model_fields_set and request.store


def row_answer(request, chat):
    """(the response object of a row's chat answer, the input items to store it with or None)."""
    stored = stored_by_row(request)
    answer = from_chat(request, new_id("resp_"), chat, int(time.time()), store=stored)
    return answer, (request.input_items() if stored else None)


def row_usage(answer):
    """A response's usage as the batch's token counts read it (prompt and completion tokens)."""
    usage = answer.get("usage") or {}
    return {"prompt_tokens": usage.get("input_tokens", 0), "completion_tokens": usage.get("output_tokens", 0)}
