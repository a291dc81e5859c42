"""Which rows generate (run alone, or seated under batched decoding) and which score (chunks),
decided as the service functions decide it."""

import pytest

from batches_app.models import BatchRow
from batches_app.chunks import PendingRow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("endpoint", "body", "generates"),
    [
        (CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": 4}, True),
        (CHAT, {"model": "m", "messages": MESSAGES, "logprobs": False, "max_tokens": 4}, True),
        (CHAT, {"model": "m", "messages": MESSAGES, "logprobs": True, "max_tokens": 1}, False),
        (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 4}, True),
        # 0 is falsy but still asks completions for scoring: it must never take a seat
        (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 1, "logprobs": 0}, False),
        (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 1, "allowed_token_ids": [1, 2]}, False),
    ],
)
def test_a_row_generates_exactly_when_the_service_function_would_generate(endpoint, body, generates):
    assert PendingRow.of(endpoint, BatchRow(body=body)).generates is generates
