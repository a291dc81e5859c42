"""generation: a file of greedy chat rows run as a batch twice on one stack, one row at a time
(`batched_decoding: false`) and many rows per forward pass (`batched_decoding: true`).
Goals: batched rows per second at least 4x the serial ones, and every row's text the same.

    python -m bench.generation [--rows 64] [--max-tokens 64] [--model PATH]

Each batch is timed from its creation to its completion by its own recorded timestamps. Rows
whose texts differ are tokenised with the model's tokenizer and the first differing token's
index reported. A server that refuses `batched_decoding` (before the step scheduler) runs only
the serial batch, without the field, and the part says so.
"""

import argparse

GOAL = 4.0
FIELD = "batched_decoding"


def main(argv=None, running=None):
    """`running`: a stack of the same model to use instead of starting one."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    args = parser.parse_args(argv)

    from bench.common import (
        CHAT, chat_lines, check, exact_check, first_difference, load_resident, output_rows, report, run_batch, scoring_texts,
        setup_django, stack_for, start_batch_unless_refused, wait_batch,
    )
    from bench.pipeline import phase_seconds

    setup_django()
    import httpx

    resident = load_resident(args.model)
    prompts = scoring_texts(resident, args.rows, seed=11, shortest=5, longest=30)
    lines = chat_lines(resident.model_id, prompts, args.max_tokens)

    def timed(client, **create):
        """(seconds from creation to completion, custom_id -> output line), or (None, why) when
        the server refused a create field."""
        batch, refused = start_batch_unless_refused(client, lines, CHAT, FIELD, **create)
        if batch is None:
            return None, refused
        batch = wait_batch(client, batch["id"])
        if batch["status"] != "completed":
            raise RuntimeError(f"batch {batch['id']} ended {batch['status']}: {batch.get('errors')}")
        return (sum(phase_seconds(running, batch["id"]).values()), output_rows(client, batch)), None

    def tokens(text):
        return resident.tokenizer(text or "", add_special_tokens=False)["input_ids"]

    with stack_for(args.model, running) as running, httpx.Client(base_url=running.web.url, timeout=600) as client:
        run_batch(client, lines[:2], CHAT)  # warm: first queries, first forward passes
        serial, refused = timed(client, **{FIELD: False})
        if serial is None:  # a server without the field runs every batch one row at a time
            serial, _ = timed(client)
        batched, refused = timed(client, **{FIELD: True})

    n = args.rows
    serial_s, serial_rows = serial
    figures = {
        "model": resident.model_id, "rows": n, "max_tokens": args.max_tokens,
        "serial_s": serial_s, "serial_rows_per_s": n / serial_s,
        "serial_tokens_per_s": completion_tokens(serial_rows) / serial_s, "batched_refused": refused,
    }
    rows = [
        ("model", f"{resident.model_id} ({resident.dtype_name}), {n} greedy chat rows of 5-30 token prompts, "
                  f"max_tokens {args.max_tokens}"),
        ("batched_decoding false", f"{figures['serial_rows_per_s']:.2f} rows/s ({serial_s:.1f} s, "
                                   f"{figures['serial_tokens_per_s']:.1f} completion tokens/s)"),
    ]
    if batched is None:
        rows.append(("batched_decoding true", f"refused by this server: {refused}"))
        return report("generation", rows, figures, [
            check("batched / serial rows per second", "not run", f">= {GOAL}x", False),
            check("rows with the same text", "not run", f"all {n}", False),
        ])
    batched_s, batched_rows = batched
    differences = {}
    for custom_id, line in serial_rows.items():
        other = batched_rows.get(custom_id)
        left, right = text_of(line), text_of(other) if other else None
        if left != right:
            differences[custom_id] = first_difference(tokens(left), tokens(right))
    same = sum(1 for custom_id in serial_rows if custom_id in batched_rows and custom_id not in differences)
    marked = sum(1 for line in batched_rows.values() if line["response"].get("millm", {}).get("batched"))
    ratio = serial_s / batched_s
    figures.update({
        "batched_s": batched_s, "batched_rows_per_s": n / batched_s,
        "batched_tokens_per_s": completion_tokens(batched_rows) / batched_s, "ratio": ratio,
        "same_text_rows": same, "rows_marked_batched": marked,
        "first_differing_token": differences,
    })
    order = sorted(differences, key=lambda custom_id: int(custom_id.split("-")[1]))
    rows += [
        ("batched_decoding true", f"{figures['batched_rows_per_s']:.2f} rows/s ({batched_s:.1f} s, "
                                  f"{figures['batched_tokens_per_s']:.1f} completion tokens/s), "
                                  f"{marked} of {len(batched_rows)} rows marked millm.batched"),
        ("first differing token", ", ".join(f"{c} at {differences[c]}" for c in order) or "none: every row the same"),
    ]
    return report("generation", rows, figures, [
        check("batched / serial rows per second", f"{ratio:.2f}x", f">= {GOAL}x", ratio >= GOAL),
        exact_check("rows with the same text", f"{same} of {n}", f"all {n}", same == n, resident.dtype_name),
    ])


def text_of(line):
    return line["response"]["body"]["choices"][0]["message"]["content"]


def completion_tokens(rows):
    return sum(line["response"]["body"]["usage"]["completion_tokens"] for line in rows.values())


if __name__ == "__main__":
    main()
