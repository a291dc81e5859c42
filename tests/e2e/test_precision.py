"""bfloat16's own promise (SPEC 7a): in every dtype a `pack: false` batch row equals the
synchronous answer (both run the one service function on the same weights); the dtype is named by
the engine's start-up line and by system_fingerprint. (The suite runs in float32, where every
exactness promise holds; this stack asks for bfloat16 by name.)"""

import httpx
import pytest

from tests.e2e.batch_helpers import (CHAT, COMPLETIONS, EMBEDDINGS, bodies, line, provenance, read_jsonl, start_batch,
                                     wait_for, without_ids)
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.stack import Stack


@pytest.fixture(scope="module")
def bfloat16(tmp_path_factory, test_model_dir):
    with Stack.running(tmp_path_factory.mktemp("bfloat16"), test_model_dir, MILLM_DTYPE="bfloat16") as stack:
        stack.client = make_client(stack.web.url)
        yield stack


def test_the_engine_and_the_fingerprint_name_the_dtype(bfloat16):
    assert "(cpu, torch.bfloat16)" in bfloat16.engine.log()
    answer = bfloat16.client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=2)
    assert answer.system_fingerprint == f"millm:{MODEL_ID}@unrecorded:bfloat16/none:transformers"


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, EMBEDDINGS])
def test_in_bfloat16_a_pack_false_row_equals_the_synchronous_answer(bfloat16, endpoint):
    requests = bodies(endpoint, 4)
    batch = start_batch(bfloat16.client, [line(f"row-{i}", endpoint, body) for i, body in enumerate(requests)], endpoint)
    done = wait_for(bfloat16.client, batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 4)
    for row, body in zip(read_jsonl(bfloat16.client, done.output_file_id), requests):
        sync = httpx.post(bfloat16.web.url + endpoint, json=body, timeout=60)
        assert sync.status_code == 200
        assert without_ids(row["response"]["body"]) == without_ids(sync.json())
        assert provenance(row["response"]["millm"]["headers"]) == provenance(sync.headers)
