"""Helpers for batch tests: JSONL lines, upload-and-create, polling to an end."""

import io
import json
import time

FINISHED = {"completed", "failed", "expired", "cancelled"}


def line(custom_id, url, body, method="POST"):
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def to_jsonl(lines):
    return "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in lines).encode()


def start_batch(client, lines, endpoint, **create):
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(to_jsonl(lines))), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h", **create)


def wait_for(client, batch_id, statuses=FINISHED, timeout=120, check=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses and (check is None or check(batch)):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} is still {batch.status}")


def read_jsonl(client, file_id):
    if file_id is None:
        return []
    return [json.loads(row) for row in client.files.content(file_id).content.decode().splitlines()]


def without_ids(body):
    return {key: value for key, value in body.items() if key not in ("id", "created")}
