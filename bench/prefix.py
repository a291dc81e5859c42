"""prefix: shared prefixes computed once (issue 45), reuse off against reuse on, and llama.cpp's
server with its prompt cache (8 slots, `cache_prompt` on, its default) on the same GGUF. One
server at a time, interleaved (--repeats rounds, medians), the same threads each, miServer in its
default engine (`auto`).

Work:
- scoring job: --scoring-rows completion scoring rows (max_tokens 1, logprobs 5), each a
  --instruction-tokens instruction then a text of 10-60 tokens; one batch with pack and
  pack_window (and `prefix_reuse` on the reuse stack); llama.cpp: 8 at a time. Rows per second.
- generation job: --generation-rows greedy chats of --max-tokens sharing a --system-tokens system
  prompt; one batch with batched_decoding (and `prefix_reuse`); llama.cpp: 16 at a time.
  Completion tokens per second.
- third turn: a 3-turn chat on the same system prompt, each turn streamed; the seconds to the
  third turn's first token (MILLM_PREFIX_REUSE on the reuse stack).

Quality, in one process on the same rows (the default dtype and float32): the rows whose top
token changed and the largest logprob difference, reuse on against reuse off, beside packing's
own difference (packed against rows run alone).

    python -m bench.prefix [--repeats 3] [--model PATH] [--chat-template NAME] [--no-llama]
"""

import argparse
import functools
import json
import statistics
import time

from bench.peers import at_once, compare, top_logprobs

OFF, ON, LLAMA = "reuse off", "reuse on", "llama.cpp"
WORK = ["scoring_job", "generation_job", "third_turn_s"]
UNITS = {"scoring_job": "rows/s", "generation_job": "tokens/s", "third_turn_s": "s"}
ENGINE = {"MILLM_DTYPE": "auto", "MILLM_WEIGHTS": "auto"}
TURNS = ["What does a lighthouse keeper do all night?", "And what does she do when a storm comes?",
         "Tell me about the ships she watched."]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scoring-rows", type=int, default=256)
    parser.add_argument("--instruction-tokens", type=int, default=400)
    parser.add_argument("--generation-rows", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--quality-rows", type=int, default=64)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    parser.add_argument("--chat-template", default=None, help="a template's name, for a file without one")
    parser.add_argument("--no-llama", action="store_true")
    args = parser.parse_args(argv)

    from bench.common import default_gguf, load_resident, report, scoring_texts, setup_django

    setup_django()
    import importlib.util

    import torch

    threads = torch.get_num_threads()
    resident = load_resident(args.model)
    instruction = words_of(resident, args.instruction_tokens, "You are an annotator. Label the text that follows "
                                                              "as positive, negative or neutral.")
    system = words_of(resident, args.system_tokens, "You are a helpful assistant who writes short, vivid stories.")
    texts = [f"{instruction}\nText: {text}\nLabel:" for text in scoring_texts(resident, args.scoring_rows)]
    del resident
    quality = measure_quality(args.model, texts[:args.quality_rows])
    prompts = [f"Write a short story about {subject}, number {index}." for index, subject in
               enumerate(["a lighthouse", "the river", "a small robot", "winter", "the market", "a violin"]
                         * (args.generation_rows // 6 + 1))][:args.generation_rows]
    llama = not args.no_llama and importlib.util.find_spec("xllamacpp") is not None
    gguf = default_gguf(args.model)
    servers = [OFF, ON] + ([LLAMA] if llama else [])
    rates = {server: {work: [] for work in WORK} for server in servers}
    for _ in range(args.repeats):
        for server in servers:
            if server == LLAMA:
                measured = measure_llama(gguf, threads, texts, system, prompts, args)
            else:
                measured = measure_miserver(args.model, server == ON, texts, system, prompts, args)
            for work, value in measured.items():
                rates[server][work].append(value)
    medians = {server: {work: statistics.median(values) for work, values in by_work.items() if values}
               for server, by_work in rates.items()}

    from bench.common import check

    rows = [("sizes", f"{args.scoring_rows} scoring rows of a {args.instruction_tokens}-token instruction and 10-60 "
                      f"tokens each; {args.generation_rows} chats of {args.max_tokens} tokens on a "
                      f"{args.system_tokens}-token system prompt; a 3-turn chat of {args.turn_tokens} tokens a turn; "
                      f"{args.repeats} interleaved round(s), medians; {threads} threads each; miServer `auto`; "
                      f"llama.cpp on {gguf.name}, 8 slots, prompt cache on"
                      + ("" if llama else " (llama.cpp not measured: xllamacpp missing or --no-llama)"))]
    for server in servers:
        rows.append((server, ", ".join(f"{work} {value:.2f} {UNITS[work]}" for work, value in medians[server].items())))
    on, off = medians[ON], medians[OFF]
    checks = [
        check("scoring job, reuse on / off", f"{on['scoring_job'] / off['scoring_job']:.2f}x", ">= 4.0x",
              on["scoring_job"] / off["scoring_job"] >= 4.0),
        check("generation job, reuse on / off", f"{on['generation_job'] / off['generation_job']:.2f}x", ">= 1.5x",
              on["generation_job"] / off["generation_job"] >= 1.5),
        check("third turn's first token, reuse on / off", f"{on['third_turn_s'] / off['third_turn_s']:.2f}x",
              "<= 0.5x", on["third_turn_s"] / off["third_turn_s"] <= 0.5),
    ]
    if llama:
        theirs = medians[LLAMA]
        ratio = on["scoring_job"] / theirs["scoring_job"]
        checks.append(check("scoring job, reuse on / llama.cpp", f"{ratio:.2f}x", ">= 3.0x", ratio >= 3.0))
        rows.append(("reuse on / llama.cpp", f"scoring job {ratio:.2f}x, generation job "
                                             f"{on['generation_job'] / theirs['generation_job']:.2f}x, third turn's "
                                             f"first token {on['third_turn_s'] / theirs['third_turn_s']:.2f}x the time"))
    for name, figures in quality.items():
        rows.append((f"quality, {figures['dtype']}", f"reuse on ({figures['rows_reusing']} rows reused a prefix) vs off "
                                                     f"(packed): {described(figures['reuse'])}; "
                                                     f"packed vs alone: {described(figures['packing'])}"))
    exact, fast = quality["float32"]["reuse"], quality["default"]
    checks.append(check("float32: reuse on vs off", described(exact), "no top token changed, logprobs within 1e-4",
                        exact["top_token_changed"] == 0 and exact["largest_logprob_difference"] <= 1e-4))
    checks.append(check(f"{fast['dtype']}: reuse on vs off", described(fast["reuse"]),
                        f"no further off than packing ({described(fast['packing'])})",
                        fast["reuse"]["top_token_changed"] <= fast["packing"]["top_token_changed"]
                        and fast["reuse"]["largest_logprob_difference"] <= fast["packing"]["largest_logprob_difference"]))
    figures = {"servers": servers, "medians": medians, "rates": rates, "quality": quality, "threads": threads,
               "gguf": str(gguf), "llamacpp": llama}
    return report("prefix", rows, figures, checks)


def words_of(resident, tokens, opening):
    """`opening`, then plain sentences until the text is `tokens` tokens long (the resident's
    tokenizer): a long instruction of ordinary words."""
    filler = ("Read each sentence with care, weigh the words the writer chose, and think about the tone before "
              "you decide. ")
    text = opening
    while len(resident.encode(text + " " + filler)) <= tokens:
        text += " " + filler
    return text.strip()


def measure_quality(model, texts):
    """{dtype: {"reuse": reuse on vs packed, "packing": packed vs alone}} on `texts`, in one process."""
    from django.conf import settings

    from bench.common import load_resident
    from inference_app.engine import packing, services
    from inference_app.schemas import parse_request

    quality, before = {}, settings.MILLM_DTYPE
    try:
        for name, dtype in (("default", "auto"), ("float32", "float32")):
            settings.MILLM_DTYPE = dtype
            resident = load_resident(model)
            rows = [parse_request("/v1/completions", {"model": resident.model_id, "prompt": text, "max_tokens": 1,
                                                      "logprobs": 5}, True) for text in texts]
            alone = [top_logprobs(services.run(resident, row).body["choices"][0]) for row in rows]
            packed = [top_logprobs(outcome.body["choices"][0]) for outcome in packing.run_packed(resident, rows)]
            outcomes = packing.run_packed(resident, rows, reuse=True)
            reused = [top_logprobs(outcome.body["choices"][0]) for outcome in outcomes]
            quality[name] = {"dtype": resident.dtype_name,
                             "rows_reusing": sum("prompt_tokens_details" in outcome.body["usage"] for outcome in outcomes),
                             "reuse": compare({"scoring_job": packed}, {"scoring_job": reused}),
                             "packing": compare({"scoring_job": alone}, {"scoring_job": packed})}
            del resident
    finally:
        settings.MILLM_DTYPE = before
    return quality


def described(figures):
    return (f"top token changed in {figures['top_token_changed']} of {figures['rows']}, largest logprob difference "
            f"{figures['largest_logprob_difference']:.2e}")


def measure_miserver(model, reuse, texts, system, prompts, args):
    import httpx

    from bench.common import stack

    settings = {**ENGINE, "MILLM_PREFIX_REUSE": reuse, "MAX_PENDING_REQUESTS": 64}
    if args.chat_template:
        settings["MILLM_CHAT_TEMPLATE"] = args.chat_template
    with stack(model, **settings) as running, httpx.Client(base_url=running.web.url, timeout=3600) as client:
        return workloads(client, running.model_id, texts, system, prompts, args, reuse=reuse, ours=True)


def measure_llama(gguf, threads, texts, system, prompts, args):
    import httpx

    from bench.concurrency import llama_server

    context = args.instruction_tokens + args.system_tokens + 3 * args.turn_tokens + 256
    serve = functools.partial(llama_server, chat_template=args.chat_template)
    measured = {}
    with serve(gguf, 8, context, threads) as url, httpx.Client(base_url=url, timeout=3600) as client:
        measured.update(workloads(client, gguf.name, texts, system, prompts, args, only={"scoring_job", "third_turn_s"}))
    with serve(gguf, 16, context, threads) as url, httpx.Client(base_url=url, timeout=3600) as client:
        measured.update(workloads(client, gguf.name, texts, system, prompts, args, only={"generation_job"}))
    return measured


def workloads(client, model_id, texts, system, prompts, args, reuse=False, ours=False, only=None):
    """{work: value} for the work this server is measured on."""
    from bench.common import CHAT, COMPLETIONS, output_rows, scoring_lines, start_batch, wait_batch

    measured = {}
    wanted = (lambda work: work in only) if only else (lambda work: True)
    create = {"prefix_reuse": True} if reuse else {}
    client.post(CHAT, json=chat(model_id, system, [], "Say hello.", 4)).raise_for_status()  # warm
    if wanted("scoring_job"):
        started = time.perf_counter()
        if ours:
            batch = wait_batch(client, start_batch(client, scoring_lines(model_id, texts), COMPLETIONS, pack=True,
                                                   pack_window=min(len(texts), 256), **create)["id"])
            if batch["status"] != "completed":
                raise RuntimeError(f"the scoring batch ended {batch['status']}: {batch.get('errors')}")
            count = len(output_rows(client, batch))
        else:
            count = len(at_once(client, COMPLETIONS, [{"model": model_id, "prompt": text, "max_tokens": 1, "logprobs": 5,
                                                       "temperature": 0} for text in texts], 8))
        measured["scoring_job"] = count / (time.perf_counter() - started)
    if wanted("generation_job"):
        bodies = [chat(model_id, system, [], prompt, args.max_tokens) for prompt in prompts]
        started = time.perf_counter()
        if ours:
            lines = [json.dumps({"custom_id": f"row-{index}", "method": "POST", "url": CHAT, "body": body})
                     for index, body in enumerate(bodies)]
            batch = wait_batch(client, start_batch(client, lines, CHAT, batched_decoding=True, **create)["id"])
            wall = time.perf_counter() - started
            answers = [row["response"]["body"] for row in output_rows(client, batch).values()]
        else:
            answers = at_once(client, CHAT, bodies, 16)
            wall = time.perf_counter() - started
        measured["generation_job"] = sum(answer["usage"]["completion_tokens"] for answer in answers) / wall
    if wanted("third_turn_s"):
        history = []
        for turn in TURNS:
            seconds, answer = first_token_seconds(client, chat(model_id, system, history, turn, args.turn_tokens))
            history += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        measured["third_turn_s"] = seconds
    return measured


def chat(model_id, system, history, question, max_tokens):
    messages = [{"role": "system", "content": system}, *history, {"role": "user", "content": question}]
    return {"model": model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def first_token_seconds(client, body):
    """(seconds to the first content of a streamed chat, the whole answer's text). On a
    connection of its own: llama.cpp's server closes a kept-alive connection after a streamed
    answer without saying so (no `Connection: close`), and the next request sent on it got
    "Server disconnected without sending a response" (xllamacpp 2026.10)."""
    started, first, parts = time.perf_counter(), None, []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                       headers={"Connection": "close"}) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta:
                first = first or time.perf_counter() - started
                parts.append(delta)
    return first or time.perf_counter() - started, "".join(parts)


if __name__ == "__main__":
    main()
