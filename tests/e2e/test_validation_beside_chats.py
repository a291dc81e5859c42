"""Validation takes no request slot (SPEC 10): while a large file validates in the engine,
interactive requests are answered (issue 16, point 6)."""

from tests.e2e.batch_helpers import line, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID

CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def test_chats_are_answered_while_a_large_file_validates(client):
    rows = [line(f"row-{n}", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": f"Row {n}"}]})
            for n in range(30_000)]  # 50,000 still had 12 s to go after three chats, once, under load
    batch = start_batch(client, rows, "/v1/chat/completions")
    wait_for(client, batch.id, statuses={"validating"}, timeout=30)

    answered = 0
    while client.batches.retrieve(batch.id).status == "validating" and answered < 3:
        answer = client.chat.completions.create(**CHAT)
        assert answer.choices[0].message.content is not None
        answered += 1
    # Each chat was sent, and answered, while the batch was still validating: validation held
    # no seat and did not hold up the engine's loop or its database thread.
    assert answered == 3, f"only {answered} chat(s) answered before validation ended"
    assert client.batches.retrieve(batch.id).status == "validating"
    client.batches.cancel(batch.id)
    wait_for(client, batch.id, timeout=120)
