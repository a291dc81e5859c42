"""Helpers for batch tests: JSONL lines, upload-and-create, polling to an end."""

import io
import json
import threading
import time

from tests.e2e.conftest import MODEL_ID
from tests.e2e.stack import ENGINE_STALE_S

FINISHED = {"completed", "failed", "expired", "cancelled"}
CHAT, COMPLETIONS, EMBEDDINGS, PROBES = "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/probes/score"


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


def assert_ran_once(stack, batch_id, lines, recorded_before, killed=(), pauses=()):
    """Executions counted, not just results (issue 26). A recorded row that ran again would leave
    its result as it was (`record` writes only pending rows), so only a count of executions sees
    it. Checked from the engines' `executed` log lines and the rows' recorded_at:

    - every line of `lines` executed, and none executed after it was recorded;
    - each line recorded before the first kill (`recorded_before`) executed exactly once in all;
    - only lines in flight at a kill ran twice: executed by a `killed` engine (or one whose
      database restarted under it) and run again after, or claimed across a host pause
      (`pauses`, HostPauses' list): the whole machine stopped longer than ENGINE_STALE_S, every
      engine looked dead to the others once it resumed, and a claim taken before the pause was
      released and taken again; every run of such a line falls between the pause's start and
      twice the stale limit after its end.

    Returns the lines that ran twice."""
    runs = stack.executions(batch_id)
    assert set(runs) >= set(lines), f"lines that never executed: {sorted(set(lines) - set(runs))}"
    recorded_at = {line: at.timestamp() for line, at in stack.sql(
        "SELECT line, recorded_at FROM batches_app_batchrow WHERE batch_id = %s AND recorded_at IS NOT NULL", [batch_id])}
    late = {line: [round(at - recorded_at[line], 3) for _, at in executed if at > recorded_at[line]]
            for line, executed in runs.items() if line in recorded_at}
    assert {line: after for line, after in late.items() if after} == {}, "lines executed after their record (s after)"
    again = {line: len(runs[line]) for line in recorded_before if len(runs.get(line, [])) != 1}
    assert again == {}, f"lines recorded before the first kill that did not execute exactly once: {again}"
    twice = sorted(line for line, executed in runs.items() if len(executed) > 1)
    not_in_flight = [line for line in twice if not any(engine in killed for engine, _ in runs[line])
                     and not any(all(start <= at <= end + 2 * HostPauses.STALE_S for _, at in runs[line])
                                 for start, end in pauses)]
    assert not_in_flight == [], f"lines that ran twice without being in flight at a kill: {not_in_flight}"
    return twice


class HostPauses(threading.Thread):
    """The moments the whole machine stopped (a virtual machine paused or forked, as the kernel
    log's "random: crng reseeded due to virtual machine fork" once showed in CI): gaps longer
    than the stacks' ENGINE_STALE_S between two readings of the wall clock 0.05 s apart. Each
    engine froze too, so on resuming it saw the others' heartbeats stale."""

    STALE_S = ENGINE_STALE_S

    def __init__(self):
        super().__init__(daemon=True)
        self.pauses = []  # (wall time before, wall time after)
        self.stopped = threading.Event()

    def run(self):
        last = time.time()
        while not self.stopped.wait(0.05):
            now = time.time()
            if now - last > self.STALE_S:
                self.pauses.append((last, now))
            last = now


def provenance(headers):
    """The X-miLLM-* headers, by lower-case name."""
    return {name.lower(): value for name, value in headers.items() if name.lower().startswith("x-millm-")}


def bodies(endpoint, count):
    """`count` request bodies of `endpoint` (the probe-score ones name no model)."""
    if endpoint == CHAT:
        return [{"model": MODEL_ID, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 6,
                 "temperature": 0, "seed": i} for i in range(count)]
    if endpoint == COMPLETIONS:
        return [{"model": MODEL_ID, "prompt": f"Number {i} is", "max_tokens": 1, "logprobs": 3} for i in range(count)]
    if endpoint == EMBEDDINGS:
        return [{"model": MODEL_ID, "input": [f"text {i}", "more"], "pooling": "last"} for i in range(count)]
    return [{"inputs": [{"text": f"probe me {i}"}], "windows": ["all"]} for i in range(count)]
