"""peers: this server against llama.cpp's server (the xllamacpp wheel) on the same GGUF, one
server at a time, interleaved (every server once per round, --repeats rounds, medians), the
same threads each. Each miServer mode is a stack of its own settings; the float32 reference
(MILLM_DTYPE=float32, MILLM_WEIGHTS=dense: the engine before issue 27) is one of them, timed
like the others, and is what quality is measured against.

Work, each as a rate (higher is better), ratio miServer / llama.cpp:
- one chat: one greedy chat of --one-chat-tokens, completion tokens per second;
- 8 chats: 8 concurrent greedy chats of --chat-tokens (bench.concurrency's measure);
- generation job: --generation-rows greedy chats as one Batch API batch with batched_decoding
  and prefix_reuse (the reference: without), against the same requests 16 at a time to a 16-slot
  llama.cpp, whose prompt cache (its default `cache_prompt`) likewise reuses the part of a slot's
  last prompt the next one begins with (the chat template's system prompt, "Write a short story
  about"); completion tokens per second;
- scoring job: --scoring-rows scoring rows (max_tokens 1, logprobs 5) of 10-60 tokens as one
  batch with pack and pack_window, against 8 at a time to an 8-slot llama.cpp; rows per second;
- synchronous scoring: the same rows as 8 concurrent synchronous requests to miServer;
- embeddings: --embedding-inputs inputs, 8 a request, 8 requests at once (llama.cpp started
  with embeddings on); inputs per second.

Quality, every server against the float32 reference on the same rows: scoring rows whose top
token changed, the largest logprob difference where the top token is the same, and greedy
generation-job rows whose text is identical.

    python -m bench.peers [--modes auto bfloat16 ...] [--repeats 3] [--model PATH] [--chat-template NAME]

A model whose file has no chat template (the second model, Gemma 3 270M) needs --chat-template:
the name goes to miServer as MILLM_CHAT_TEMPLATE and to llama.cpp as its built-in template of
that name, so both render the same prompts.
"""

import argparse
import concurrent.futures
import functools
import json
import statistics
import time
from types import SimpleNamespace

# The settings of each miServer mode a run may name (--modes); the reference always runs.
MODES = {
    "auto": {"MILLM_DTYPE": "auto", "MILLM_WEIGHTS": "auto"},
    "bfloat16": {"MILLM_DTYPE": "bfloat16", "MILLM_WEIGHTS": "dense"},
    "bfloat16+packed": {"MILLM_DTYPE": "bfloat16", "MILLM_WEIGHTS": "auto"},
    "float32+packed": {"MILLM_DTYPE": "float32", "MILLM_WEIGHTS": "quantized"},
    "auto+compiled": {"MILLM_DTYPE": "auto", "MILLM_WEIGHTS": "auto", "MILLM_COMPILE": "decode"},
}
REFERENCE = "float32 (reference)"
REFERENCE_SETTINGS = {"MILLM_DTYPE": "float32", "MILLM_WEIGHTS": "dense"}
LLAMA = "llama.cpp"
WORK = ["one_chat", "chats", "generation_job", "scoring_job", "sync_scoring", "embeddings"]
# The goals for the default mode (ratio miServer / llama.cpp); sync scoring is compared
# with llama.cpp's scoring at 8 requests at once.
GOALS = {"scoring_job": 2.0, "chats": 1.0, "generation_job": 1.0, "sync_scoring": 1.0, "one_chat": 0.5,
         "embeddings": 1.5}
THEIRS = {"sync_scoring": "scoring_job"}
UNITS = {"one_chat": "tokens/s", "chats": "tokens/s", "generation_job": "tokens/s", "scoring_job": "rows/s",
         "sync_scoring": "rows/s", "embeddings": "inputs/s"}
STORY = "Tell me a long story about a lighthouse keeper and the ships she watched."


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", nargs="*", default=["auto"], choices=sorted(MODES),
                        help="miServer modes beside the float32 reference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one-chat-tokens", type=int, default=200)
    parser.add_argument("--chat-tokens", type=int, default=64)
    parser.add_argument("--generation-rows", type=int, default=64)
    parser.add_argument("--scoring-rows", type=int, default=256)
    parser.add_argument("--embedding-inputs", type=int, default=64)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    parser.add_argument("--chat-template", default=None,
                        help="a well-known template's name (gemma, chatml, ...) for a model whose file has none")
    parser.add_argument("--no-llama", action="store_true", help="miServer's modes only (a GPU run)")
    args = parser.parse_args(argv)

    from bench.common import default_gguf, load_resident, report, scoring_texts, setup_django

    setup_django()
    import importlib.util

    import torch

    threads = torch.get_num_threads()
    resident = load_resident(args.model)
    if not (resident.chat_template.present or args.chat_template):
        parser.error(f"{resident.model_id} has no chat template of its own: name one with --chat-template")
    texts = scoring_texts(resident, args.scoring_rows)
    del resident
    prompts = [f"Write a short story about {subject}, number {index}."
               for index, subject in enumerate(_subjects(args.generation_rows))]
    llama = not args.no_llama and importlib.util.find_spec("xllamacpp") is not None
    gguf = default_gguf(args.model)
    servers = [REFERENCE, *args.modes] + ([LLAMA] if llama else [])
    rates = {server: {work: [] for work in WORK} for server in servers}
    outputs = {}
    for _ in range(args.repeats):
        for server in servers:
            if server == LLAMA:
                measured = measure_llama(gguf, threads, texts, prompts, args)
            else:
                settings = REFERENCE_SETTINGS if server == REFERENCE else MODES[server]
                if args.chat_template:
                    settings = {**settings, "MILLM_CHAT_TEMPLATE": args.chat_template}
                measured = measure_miserver(args.model, settings, texts, prompts, args, reuse=server != REFERENCE)
            for work, (rate, output) in measured.items():
                rates[server][work].append(rate)
                if output is not None:
                    outputs.setdefault(server, {})[work] = output
    medians = {server: {work: statistics.median(values) for work, values in by_work.items() if values}
               for server, by_work in rates.items()}
    quality = {server: compare(outputs[REFERENCE], outputs.get(server, {})) for server in servers if server != REFERENCE}

    rows = [("sizes", f"one chat of {args.one_chat_tokens} tokens; 8 chats of {args.chat_tokens}; a "
                      f"{args.generation_rows}-row generation job of {args.chat_tokens} tokens (prefix_reuse but in the reference; "
                      f"llama.cpp's prompt cache on); {args.scoring_rows} "
                      f"scoring rows of 10-60 tokens; {args.embedding_inputs} embedding inputs; {args.repeats} "
                      f"interleaved round(s), medians; {threads} threads each; llama.cpp on {gguf.name}"
                      + (f"; chat template {args.chat_template!r} on both" if args.chat_template else "")
                      + ("" if llama else " (not measured: xllamacpp missing or --no-llama)"))]
    for server in servers:
        figures = ", ".join(f"{work} {value:.1f} {UNITS[work]}" for work, value in medians[server].items())
        rows.append((server, figures))
    checks = []
    if llama:
        for server in servers[:-1]:
            ratios = ratios_of(medians[server], medians[LLAMA])
            rows.append((f"{server} / llama.cpp", ", ".join(f"{work} {ratio:.2f}x" for work, ratio in ratios.items())))
        main_mode = args.modes[0] if args.modes else REFERENCE
        for work, ratio in ratios_of(medians[main_mode], medians[LLAMA]).items():
            checks.append(check_ratio(f"{work} ({main_mode}) / llama.cpp", ratio, GOALS[work]))
    else:
        from bench.common import check

        checks.append(check("ratios against llama.cpp", "not measured", "xllamacpp installed (the bench extra)", False))
    for server, figures in quality.items():
        rows.append((f"quality of {server} vs float32", describe_quality(figures)))
    if llama and args.modes:
        ours, theirs = quality[args.modes[0]], quality[LLAMA]
        from bench.common import check

        checks.append(check(f"quality ({args.modes[0]}) vs float32", describe_quality(ours),
                            f"no further off than llama.cpp ({describe_quality(theirs)})", no_further_off(ours, theirs)))
    figures = {"servers": servers, "medians": medians, "rates": rates, "quality": quality, "threads": threads,
               "gguf": str(gguf), "llamacpp": llama}
    return report("peers", rows, figures, checks)


def _subjects(count):
    subjects = ["a lighthouse", "the river", "a small robot", "winter", "the market", "a violin", "the moon",
                "an old map", "bread", "the train", "a garden", "the storm", "a clock", "the desert", "a letter",
                "the forest"]
    return [subjects[index % len(subjects)] for index in range(count)]


def ratios_of(ours, theirs):
    return {work: ours[work] / theirs[THEIRS.get(work, work)] for work in WORK
            if work in ours and theirs.get(THEIRS.get(work, work))}


def check_ratio(figure, ratio, goal):
    from bench.common import check

    return check(figure, f"{ratio:.2f}x", f">= {goal:.1f}x", ratio >= goal)


def measure_miserver(model, settings, texts, prompts, args, reuse=False):
    import httpx

    from bench.common import stack_or_open

    with stack_or_open(model, MAX_PENDING_REQUESTS=64, **settings) as running:
        with httpx.Client(base_url=running.web.url, timeout=3600) as client:
            return workloads(client, running.model_id, texts, prompts, args, ours=True, reuse=reuse)


def measure_llama(gguf, threads, texts, prompts, args):
    import httpx

    from bench.concurrency import llama_server

    measured = {}
    context = 256 + max(args.one_chat_tokens, args.chat_tokens)
    llama_server = functools.partial(llama_server, chat_template=args.chat_template)
    with llama_server(gguf, 8, context, threads) as url, httpx.Client(base_url=url, timeout=3600) as client:
        measured.update(workloads(client, gguf.name, texts, prompts, args, ours=False, only={"one_chat", "chats", "scoring_job"}))
    with llama_server(gguf, 16, context, threads) as url, httpx.Client(base_url=url, timeout=3600) as client:
        measured.update(workloads(client, gguf.name, texts, prompts, args, ours=False, only={"generation_job"}))
    with llama_server(gguf, 8, context, threads, embedding=True) as url, httpx.Client(base_url=url, timeout=3600) as client:
        measured.update(workloads(client, gguf.name, texts, prompts, args, ours=False, only={"embeddings"}))
    return measured


def workloads(client, model_id, texts, prompts, args, ours, only=None, reuse=False):
    """{work: (rate, outputs or None)} for the work this server is measured on; `reuse`: the
    generation job's batch asks for prefix_reuse."""
    from bench.common import CHAT, COMPLETIONS, chat_body, chat_lines, output_rows, scoring_lines, start_batch, wait_batch
    from bench.concurrency import measure

    measured = {}
    wanted = (lambda work: work in only) if only else (lambda work: ours or work != "sync_scoring")
    # Warm: the first answer of a fresh server pays for lazy set-up.
    client.post(CHAT, json=chat_body(model_id, "Say hello.", 4)).raise_for_status()
    if wanted("one_chat"):
        started = time.perf_counter()
        answer = client.post(CHAT, json=chat_body(model_id, STORY, args.one_chat_tokens))
        answer.raise_for_status()
        measured["one_chat"] = (answer.json()["usage"]["completion_tokens"] / (time.perf_counter() - started), None)
    if wanted("chats"):
        level = measure(str(client.base_url), model_id, 8,
                        SimpleNamespace(max_tokens=args.chat_tokens, rounds=1, time_limit=900))
        measured["chats"] = (level["tokens_per_s"], None)
    if wanted("generation_job"):
        bodies = [chat_body(model_id, prompt, args.chat_tokens) for prompt in prompts]
        started = time.perf_counter()
        if ours:
            reusing = {"prefix_reuse": True} if reuse else {}
            batch = wait_batch(client, start_batch(client, chat_lines(model_id, prompts, args.chat_tokens), CHAT,
                                                   batched_decoding=True, **reusing)["id"])
            wall = time.perf_counter() - started
            answers = [row["response"]["body"] for _, row in sorted(output_rows(client, batch).items(), key=_row_order)]
        else:
            answers = at_once(client, CHAT, bodies, 16)
            wall = time.perf_counter() - started
        tokens = sum(answer["usage"]["completion_tokens"] for answer in answers)
        measured["generation_job"] = (tokens / wall, [answer["choices"][0]["message"]["content"] for answer in answers])
    scoring_bodies = [{"model": model_id, "prompt": text, "max_tokens": 1, "logprobs": 5, "temperature": 0}
                      for text in texts]
    if wanted("scoring_job"):
        started = time.perf_counter()
        if ours:
            batch = wait_batch(client, start_batch(client, scoring_lines(model_id, texts), COMPLETIONS, pack=True,
                                                   pack_window=min(len(texts), 256))["id"])
            wall = time.perf_counter() - started
            answers = [row["response"]["body"] for _, row in sorted(output_rows(client, batch).items(), key=_row_order)]
        else:
            answers = at_once(client, COMPLETIONS, scoring_bodies, 8)
            wall = time.perf_counter() - started
        measured["scoring_job"] = (len(answers) / wall, [top_logprobs(answer["choices"][0]) for answer in answers])
    if wanted("sync_scoring"):
        started = time.perf_counter()
        answers = at_once(client, COMPLETIONS, scoring_bodies, 8)
        measured["sync_scoring"] = (len(answers) / (time.perf_counter() - started), None)
    if wanted("embeddings"):
        inputs = [text for text, _ in zip(texts * 2, range(args.embedding_inputs))]
        bodies = [{"model": model_id, "input": inputs[start:start + 8]} for start in range(0, len(inputs), 8)]
        started = time.perf_counter()
        answers = at_once(client, "/v1/embeddings", bodies, 8)
        measured["embeddings"] = (sum(len(answer["data"]) for answer in answers) / (time.perf_counter() - started), None)
    return measured


def _row_order(item):
    return int(item[0].rpartition("-")[2])


def at_once(client, path, bodies, concurrency):
    """Every body, `concurrency` requests in flight at a time; the answers in body order."""
    def post(body):
        answer = client.post(path, json=body)
        if answer.status_code != 200:
            raise RuntimeError(f"{client.base_url}{path} answered {answer.status_code}: {answer.text[:500]}")
        return answer.json()

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(post, bodies))


def top_logprobs(choice):
    """{token: logprob} of the first position's top tokens, from either server's shape: the
    legacy completions one (`top_logprobs: [{token: logprob}]`) or llama.cpp's (`content`)."""
    logprobs = choice.get("logprobs") or {}
    if logprobs.get("content"):
        return {item["token"]: item["logprob"] for item in logprobs["content"][0]["top_logprobs"]}
    return dict(logprobs["top_logprobs"][0])


def compare(reference, other):
    """Top tokens changed, the largest logprob difference at an unchanged top token, identical
    greedy texts: `other` against the float32 reference on the same rows."""
    figures = {}
    if "scoring_job" in other:
        changed, largest = 0, 0.0
        for mine, theirs in zip(reference["scoring_job"], other["scoring_job"]):
            top = max(mine, key=mine.get)
            if max(theirs, key=theirs.get) != top:
                changed += 1
            else:
                largest = max(largest, abs(mine[top] - theirs[top]))
        figures.update(rows=len(other["scoring_job"]), top_token_changed=changed, largest_logprob_difference=largest)
    if "generation_job" in other:
        same = sum(mine == theirs for mine, theirs in zip(reference["generation_job"], other["generation_job"]))
        figures.update(greedy_rows=len(other["generation_job"]), greedy_rows_identical=same)
    return figures


def describe_quality(figures):
    parts = []
    if "rows" in figures:
        parts.append(f"top token changed in {figures['top_token_changed']} of {figures['rows']}, largest logprob "
                     f"difference {figures['largest_logprob_difference']:.3f}")
    if "greedy_rows" in figures:
        parts.append(f"{figures['greedy_rows_identical']} of {figures['greedy_rows']} greedy rows identical")
    return "; ".join(parts) or "not measured"


def no_further_off(ours, theirs):
    return (ours.get("top_token_changed", 0) <= theirs.get("top_token_changed", 0)
            and ours.get("largest_logprob_difference", 0) <= theirs.get("largest_logprob_difference", 0)
            and ours.get("greedy_rows_identical", 0) >= theirs.get("greedy_rows_identical", 0))


if __name__ == "__main__":
    print(json.dumps(main()["medians"], indent=2))
