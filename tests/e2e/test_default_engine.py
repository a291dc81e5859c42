"""The default engine end to end (issue 46): what `make run` runs, on a CPU with native bfloat16:
the packaged SmolLM2 GGUF in `MILLM_DTYPE=auto` and `MILLM_WEIGHTS=auto` (bfloat16, packed int4
projections, decode attention in the dtype `auto` timed faster), real processes. The rest of the suite pins float32; this
module is the one that serves what ships. Skipped, naming the flags, where the CPU has no native
bfloat16 (`auto` is the float32 reference there, which the rest of the suite runs)."""

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from inference_app.catalogue import default_model_path, model_source
from inference_app.engine import timed_widths
from inference_app.engine.loader import NATIVE_BFLOAT16, cpu_flags
from tests.conftest import ROOT, TEST_TIMINGS
from tests.e2e.batch_helpers import line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import make_client
from tests.e2e.stack import Stack

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"

pytestmark = pytest.mark.skipif(not NATIVE_BFLOAT16 & cpu_flags(),
                                reason="this CPU has neither avx512_bf16 nor amx_bf16: `auto` runs float32 here")


@pytest.fixture(scope="module")
def default(tmp_path_factory):
    source = model_source(None)
    work = tmp_path_factory.mktemp("default-engine")
    # The GGUF's conversion is shared with every other use of the default model on this machine.
    shared = ROOT / "var" / "model-cache"
    shared.mkdir(parents=True, exist_ok=True)
    (work / "data").mkdir()
    (work / "data" / "model-cache").symlink_to(shared)
    settings = {"MILLM_DTYPE": "auto", "MILLM_WEIGHTS": "auto", "MILLM_MODEL_ID": source.model_id,
                "ENGINE_MAX_SEQUENCES": 4, "BATCH_WAIT_POLL_S": 0.2}
    started = time.time()
    with Stack.running(work, default_model_path(), **settings) as stack:
        stack.client = make_client(stack.web.url)
        stack.started = started
        stack.id = source.model_id
        yield stack


def ask(stack, path, body):
    answer = httpx.post(stack.web.url + path, json={"model": stack.id, **body}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_fingerprint_names_bfloat16_and_packed_weights(default):
    chat = ask(default, CHAT, {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0})
    assert ":bfloat16/Q4_1+packed:" in chat["system_fingerprint"], chat["system_fingerprint"]
    assert chat["choices"][0]["message"]["content"]


def test_the_widths_it_timed_are_kept_with_the_suites_timings_not_beside_the_shared_cache(default):
    folder = Path(re.search(r"loading \S+ from (\S+) \(", default.engine.log()).group(1))
    kept = TEST_TIMINGS / f"{folder.name}-{timed_widths.FILE}"
    assert kept.exists() and json.loads(kept.read_text()), kept  # this engine's, or an earlier run's
    beside = folder / timed_widths.FILE  # what `make run` and the bench read: not written by the suite
    assert not beside.exists() or beside.stat().st_mtime < default.started, beside


def test_chat_scoring_and_embeddings_answer(default):
    scored = ask(default, COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 1, "logprobs": 3})
    top = scored["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) == 3 and max(top.values()) == scored["choices"][0]["logprobs"]["token_logprobs"][0]
    vectors = ask(default, EMBEDDINGS, {"input": ["one", "two"]})["data"]
    assert len(vectors) == 2 and len(vectors[0]["embedding"]) == 576


def test_a_pack_false_batch_equals_the_synchronous_answers_bit_for_bit(default):
    bodies = [{"model": default.id, "prompt": f"Review {i}: the film was", "max_tokens": 1, "logprobs": 3} for i in range(4)]
    rows = [line(f"r{i}", COMPLETIONS, body) for i, body in enumerate(bodies)]
    done = wait_for(default.client, start_batch(default.client, rows, COMPLETIONS).id, timeout=300)
    assert done.status == "completed"
    for row in read_jsonl(default.client, done.output_file_id):
        index = int(row["custom_id"][1:])
        sync = ask(default, COMPLETIONS, bodies[index])
        assert row["response"]["millm"]["packed"] is False
        assert row["response"]["body"]["choices"][0]["logprobs"] == sync["choices"][0]["logprobs"]  # every bit


def test_a_packed_batch_a_batched_decoding_batch_and_a_structured_row_run(default):
    client = default.client
    scoring = [line(f"s{i}", COMPLETIONS, {"model": default.id, "prompt": f"Sentence {i} is", "max_tokens": 1,
                                            "logprobs": 2}) for i in range(6)]
    packed = wait_for(client, start_batch(client, scoring, COMPLETIONS, extra_body={"pack": True}).id, timeout=300)
    assert packed.status == "completed"
    assert {row["response"]["millm"]["packed"] for row in read_jsonl(client, packed.output_file_id)} == {True}
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    chats = [line(f"g{i}", CHAT, {"model": default.id, "messages": [{"role": "user", "content": f"Tell me about {i}."}],
                                  "max_tokens": 12, "temperature": 0}) for i in range(4)]
    chats.append(line("structured", CHAT, {"model": default.id, "messages": [{"role": "user", "content": "A colour?"}],
                                           "max_tokens": 20, "response_format": {"type": "json_schema", "json_schema": {
                                               "name": "c", "schema": schema, "strict": True}}}))
    seated = wait_for(client, start_batch(client, chats, CHAT, extra_body={"batched_decoding": True}).id, timeout=300)
    assert seated.status == "completed"
    output = {row["custom_id"]: row["response"] for row in read_jsonl(client, seated.output_file_id)}
    assert sum(output[f"g{i}"]["millm"]["batched"] for i in range(4)) >= 2  # rows shared decode steps
    assert json.loads(output["structured"]["body"]["choices"][0]["message"]["content"])["colour"] in ("red", "green", "blue")
