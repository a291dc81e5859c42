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


def assert_ran_once(stack, batch_id, lines, recorded_before, killed=()):
    """Executions counted, not just results (issue 26): every line of `lines` executed, each one
    recorded before a kill (`recorded_before`) exactly once in all, and only lines in flight at a
    kill ran twice: executed by a `killed` engine (or one whose database restarted under it) and
    not recorded before the kill. A recorded row that ran again would leave its result as it was
    (`record` writes only pending rows), so only this count sees it. Returns the lines that ran
    twice."""
    runs = stack.executions(batch_id)
    assert set(runs) >= set(lines), f"lines that never executed: {sorted(set(lines) - set(runs))}"
    again = {line: len(engines) for line, engines in runs.items() if line in recorded_before and len(engines) != 1}
    assert again == {}, f"lines recorded before the kill that executed again (line: executions): {again}"
    in_flight = {line for line, engines in runs.items() if any(engine in killed for engine in engines)} - set(recorded_before)
    twice = {line for line, engines in runs.items() if len(engines) > 1}
    assert twice <= in_flight, (f"lines that ran twice without being in flight at a kill: {sorted(twice - in_flight)} "
                                f"(in flight: {sorted(in_flight)})")
    return sorted(twice)
