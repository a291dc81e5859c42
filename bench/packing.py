"""Packing: single rows versus packs in file order versus length-aware packs, on one model, in
one run, with the differences packing makes.

    python -m bench.packing [--rows 512] [--repeats 3] [--window 256] [--model PATH]

Rows are completions in scoring mode (max_tokens 1, logprobs 5) with prompts of 10 to 60 tokens
in random order; embeddings use the same texts. The default model is the packaged SmolLM2.
"""

import argparse


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=256, help="pack_window of the length-aware run")
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    args = parser.parse_args(argv)

    from bench.common import check, interleaved_medians, load_resident, report, scoring_texts, setup_django

    setup_django()
    import torch
    from django.conf import settings

    from inference_app.engine import packing, services
    from inference_app.schemas import parse_request

    resident = load_resident(args.model)
    texts = scoring_texts(resident, args.rows)
    scoring = [parse_request("/v1/completions", {"model": resident.model_id, "prompt": text, "max_tokens": 1, "logprobs": 5}, True)
               for text in texts]
    embedding = [parse_request("/v1/embeddings", {"model": resident.model_id, "input": text}, True) for text in texts]
    size = settings.BATCH_PACK_MAX_ROWS

    def single(rows):
        return [services.run(resident, row) for row in rows]

    def in_file_order(rows):
        results = []
        for start in range(0, len(rows), size):
            results.extend(packing.run_packed(resident, rows[start : start + size]))
        return results

    lengths = {id(row): max(len(ids) for ids in services.plan(resident, row)) for row in scoring + embedding}

    def length_aware(rows):
        results, pending = {}, list(rows)
        while pending:
            chosen = packing.choose_pack(pending[: args.window], lambda row: lengths[id(row)], size)
            for row, outcome in zip(chosen, packing.run_packed(resident, chosen)):
                results[id(row)] = outcome
            chosen_ids = {id(row) for row in chosen}
            pending = [row for row in pending if id(row) not in chosen_ids]
        return [results[id(row)] for row in rows]

    with torch.inference_mode():
        single(scoring[:8])  # warm up
        seconds, results = interleaved_medians(
            {"single": lambda: single(scoring), "file": lambda: in_file_order(scoring),
             "aware": lambda: length_aware(scoring)},
            args.repeats,
        )
        single_s, file_s, aware_s = seconds["single"], seconds["file"], seconds["aware"]
        alone, together = results["single"], results["aware"]
        seconds, results = interleaved_medians(
            {"single": lambda: single(embedding), "aware": lambda: length_aware(embedding)}, 1
        )
        embed_single_s, embed_aware_s = seconds["single"], seconds["aware"]
        embed_alone, embed_together = results["single"], results["aware"]

    largest, changed = 0.0, 0
    for a, b in zip(alone, together):
        one, two = a.body["choices"][0]["logprobs"], b.body["choices"][0]["logprobs"]
        changed += one["tokens"] != two["tokens"]
        largest = max(largest, abs(one["token_logprobs"][0] - two["token_logprobs"][0]))
    cosines = []
    for a, b in zip(embed_alone, embed_together):
        x = torch.tensor(a.body["data"][0]["embedding"])
        y = torch.tensor(b.body["data"][0]["embedding"])
        cosines.append(float(torch.nn.functional.cosine_similarity(x, y, dim=0)))

    n = len(scoring)
    figures = {
        "model": resident.model_id,
        "dtype": resident.dtype_name,
        "rows": n,
        "pack_rows": size,
        "pack_window": args.window,
        "single_rows_per_s": n / single_s,
        "packed_file_order_rows_per_s": n / file_s,
        "packed_length_aware_rows_per_s": n / aware_s,
        "file_order_speedup": single_s / file_s,
        "length_aware_speedup": single_s / aware_s,
        "largest_logprob_difference": largest,
        "top_token_changed_share": changed / n,
        "embeddings_single_rows_per_s": n / embed_single_s,
        "embeddings_length_aware_rows_per_s": n / embed_aware_s,
        "embeddings_min_cosine": min(cosines),
    }
    checks = [
        check("length-aware packed / single", f"{figures['length_aware_speedup']:.2f}x", ">= 2x", figures["length_aware_speedup"] >= 2),
    ]
    return report("packing", [
        ("model", f"{resident.model_id} ({resident.dtype_name}), {n} rows of 10-60 tokens, packs of {size}"),
        ("single", f"{figures['single_rows_per_s']:.1f} rows/s"),
        ("packed, file order", f"{figures['packed_file_order_rows_per_s']:.1f} rows/s ({figures['file_order_speedup']:.2f}x)"),
        (f"packed, length-aware ({args.window})", f"{figures['packed_length_aware_rows_per_s']:.1f} rows/s ({figures['length_aware_speedup']:.2f}x)"),
        ("largest logprob difference", f"{largest:.2e}"),
        ("rows whose top token changed", f"{changed} of {n} ({100 * changed / n:.2f}%)"),
        ("embeddings single / length-aware", f"{figures['embeddings_single_rows_per_s']:.1f} / {figures['embeddings_length_aware_rows_per_s']:.1f} rows/s"),
        ("embeddings min cosine", f"{min(cosines):.7f}"),
    ], figures, checks)


if __name__ == "__main__":
    main()
