"""pack: true in a real batch: scoring and embedding rows packed, the rest never."""

import httpx

from tests.e2e.batch_helpers import line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID
from tests.e2e.test_probes import probe_body

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
TEXTS = ["a", "a somewhat longer prompt for the pack", "mid length one", "x " * 30, "tiny", "the end of it all"]


def test_packed_scoring_rows_say_so_and_keep_the_synchronous_headers(stack, client):
    lines = [line(f"s{i}", COMPLETIONS, {"model": MODEL_ID, "prompt": text, "max_tokens": 1, "logprobs": 2})
             for i, text in enumerate(TEXTS)]
    lines.append(line("gen", COMPLETIONS, {"model": MODEL_ID, "prompt": "generate", "max_tokens": 3}))
    batch = start_batch(client, lines, COMPLETIONS, extra_body={"pack": True, "pack_window": 4})
    done = wait_for(client, batch.id)
    assert done.status == "completed"
    echoed = httpx.get(stack.web.url + f"/v1/batches/{batch.id}").json()["millm"]
    assert (echoed["pack"], echoed["pack_window"]) == (True, 4)
    output = read_jsonl(client, done.output_file_id)
    assert [row["custom_id"] for row in output] == [f"s{i}" for i in range(len(TEXTS))] + ["gen"]  # input order
    packed = {row["custom_id"]: row["response"]["millm"]["packed"] for row in output}
    assert packed == {**{f"s{i}": True for i in range(len(TEXTS))}, "gen": False}  # generation never packs
    for row in output:
        assert row["response"]["millm"]["headers"]["X-miLLM-Backend"] == "serial"
    sync = httpx.post(stack.web.url + COMPLETIONS, json={"model": MODEL_ID, "prompt": TEXTS[3], "max_tokens": 1, "logprobs": 2}).json()
    together = output[3]["response"]["body"]["choices"][0]["logprobs"]
    assert together["tokens"] == sync["choices"][0]["logprobs"]["tokens"]
    assert abs(together["token_logprobs"][0] - sync["choices"][0]["logprobs"]["token_logprobs"][0]) < 1e-5


def test_packed_embeddings_and_never_packed_probe_rows(stack, client):
    rows = [line(f"e{i}", EMBEDDINGS, {"model": MODEL_ID, "input": [text, "and more"]}) for i, text in enumerate(TEXTS)]
    done = wait_for(client, start_batch(client, rows, EMBEDDINGS, extra_body={"pack": True}).id)
    assert {row["response"]["millm"]["packed"] for row in read_jsonl(client, done.output_file_id)} == {True}

    probe = httpx.post(stack.web.url + "/api/probes", json=probe_body(name="packing-probe")).json()["data"]
    try:
        probe_rows = [line(f"p{i}", "/api/probes/score", {"probe_ids": [probe["id"]], "inputs": [{"text": text}]})
                      for i, text in enumerate(TEXTS[:3])]
        done = wait_for(client, start_batch(client, probe_rows, "/api/probes/score", extra_body={"pack": True}).id)
        assert {row["response"]["millm"]["packed"] for row in read_jsonl(client, done.output_file_id)} == {False}
    finally:
        httpx.delete(stack.web.url + f"/api/probes/{probe['id']}")


def test_without_pack_every_line_says_it_was_not_packed(client):
    rows = [line(f"c{i}", CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
                                 "logprobs": True}) for i, text in enumerate(TEXTS[:3])]
    done = wait_for(client, start_batch(client, rows, CHAT).id)
    assert {row["response"]["millm"]["packed"] for row in read_jsonl(client, done.output_file_id)} == {False}
