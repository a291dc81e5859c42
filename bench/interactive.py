"""interactive: chat latency (p50, p99) while a batch runs versus idle, the same requests.
Goal: p99 during a batch no more than the idle p99 plus one chunk's duration.

    python -m bench.interactive [--requests 40] [--batch-rows 2000] [--model PATH] [--batched-decoding]
                                [--rate-seconds 3]

One chunk's duration is measured on the running batch itself, before the chat requests start:
its rows per second, times BATCH_CHUNK_ROWS.

--batched-decoding: the batch is of greedy generation rows (--batch-max-tokens each) created with
`batched_decoding: true`, whose rows share forward passes with the chats; its goal is p99 during
the batch at most 1.5 times the idle p99 (written to interactive-batched.json). A server that
refuses the field reports the goal missed.
"""

import argparse

BATCHED_GOAL = 1.5  # --batched-decoding: p99 during the batch at most this times the idle p99


def main(argv=None, running=None):
    """`running`: a stack of the same model to use instead of starting one."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--batch-rows", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    parser.add_argument("--batched-decoding", action="store_true", help="a batched_decoding generation batch")
    parser.add_argument("--batch-max-tokens", type=int, default=64, help="each generation row's, with --batched-decoding")
    parser.add_argument("--rate-seconds", type=float, default=3.0, help="how long the scoring batch's rate is measured")
    args = parser.parse_args(argv)

    from bench.common import (
        CHAT, COMPLETIONS, chat_lines, check, percentile, report, scoring_lines, setup_django, stack_for, start_batch,
        start_batch_unless_refused,
    )

    setup_django()
    import time

    import httpx
    from django.conf import settings

    def chat_latencies(client, model_id):
        seconds = []
        for index in range(args.requests):
            body = {"model": model_id, "messages": [{"role": "user", "content": f"Name a colour, number {index}."}],
                    "max_tokens": args.max_tokens, "temperature": 0}
            started = time.perf_counter()
            answer = client.post("/v1/chat/completions", json=body)
            seconds.append(time.perf_counter() - started)
            answer.raise_for_status()
        return seconds

    def rows_done(client, batch_id):
        return client.get(f"/v1/batches/{batch_id}").json()["request_counts"]["completed"]

    with stack_for(args.model, running) as running, httpx.Client(base_url=running.web.url, timeout=600) as client:
        model_id = running.model_id
        prompts = [f"Item {index}: a sentence of some length about a thing, to be scored." for index in range(args.batch_rows)]
        chat_latencies(client, model_id)  # warm
        idle = chat_latencies(client, model_id)
        if args.batched_decoding:
            batch, refused = start_batch_unless_refused(client, chat_lines(model_id, prompts, args.batch_max_tokens), CHAT,
                                                        "batched_decoding", batched_decoding=True)
            if batch is None:
                return report("interactive-batched", [("batched_decoding", f"refused by this server: {refused}")],
                              {"model": model_id, "batched_refused": refused, "idle_p99_s": percentile(idle, 0.99)},
                              [check("p99 during a batched_decoding batch", "not run", f"<= {BATCHED_GOAL} x idle p99", False)])
        else:
            batch = start_batch(client, scoring_lines(model_id, prompts, logprobs=2), COMPLETIONS)
        while rows_done(client, batch["id"]) < settings.BATCH_CHUNK_ROWS:
            time.sleep(0.05)
        first, started = rows_done(client, batch["id"]), time.perf_counter()
        if not args.batched_decoding:  # scoring: the rate (and so one chunk's time) before the chats
            time.sleep(args.rate_seconds)
            rate = (rows_done(client, batch["id"]) - first) / (time.perf_counter() - started)
        busy = chat_latencies(client, model_id)
        if args.batched_decoding:  # 64-token rows end many at a time: the rate while the chats ran
            rate = (rows_done(client, batch["id"]) - first) / (time.perf_counter() - started)
        still_running = client.get(f"/v1/batches/{batch['id']}").json()["status"] == "in_progress"
        client.post(f"/v1/batches/{batch['id']}/cancel")
    chunk = settings.BATCH_CHUNK_ROWS / rate if rate else float("inf")
    figures = {
        "model": model_id, "requests": args.requests, "max_tokens": args.max_tokens,
        "idle_p50_s": percentile(idle, 0.5), "idle_p99_s": percentile(idle, 0.99),
        "busy_p50_s": percentile(busy, 0.5), "busy_p99_s": percentile(busy, 0.99),
        "batch_rows_per_s": rate, "chunk_s": chunk, "batch_ran_throughout": still_running,
        "idle_s": [round(value, 3) for value in idle], "busy_s": [round(value, 3) for value in busy],
    }
    rows = [
        ("model", f"{model_id}, {args.requests} chats of {args.max_tokens} tokens, idle then beside "
                  + (f"a batched_decoding batch of {args.batch_max_tokens}-token chat rows" if args.batched_decoding
                     else "a scoring batch")),
        ("idle p50 / p99", f"{figures['idle_p50_s'] * 1000:.0f} / {figures['idle_p99_s'] * 1000:.0f} ms"),
        ("during a batch p50 / p99", f"{figures['busy_p50_s'] * 1000:.0f} / {figures['busy_p99_s'] * 1000:.0f} ms"),
        ("the batch", f"{rate:.1f} rows/s" + (" while the chats ran" if args.batched_decoding else
                                              f", one chunk ({settings.BATCH_CHUNK_ROWS} rows) {chunk * 1000:.0f} ms")
                      + ("" if still_running else " (it ended before the chats did: raise --batch-rows)")),
    ]
    busy_p99 = f"{figures['busy_p99_s'] * 1000:.0f} ms"
    if args.batched_decoding:
        bound = figures["idle_p99_s"] * BATCHED_GOAL
        return report("interactive-batched", rows, figures, [
            check("p99 during a batched_decoding batch", busy_p99, f"<= {BATCHED_GOAL} x idle p99 = {bound * 1000:.0f} ms",
                  figures["busy_p99_s"] <= bound and still_running),
        ])
    bound = figures["idle_p99_s"] + chunk
    return report("interactive", rows, figures, [
        check("p99 during a batch", busy_p99, f"<= idle p99 + one chunk = {bound * 1000:.0f} ms",
              figures["busy_p99_s"] <= bound and still_running),
    ])


if __name__ == "__main__":
    main()
