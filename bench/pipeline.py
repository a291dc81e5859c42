"""pipeline: rows per second through the whole batch path (upload, validate, run, assemble,
download) versus the bare service function called in a loop on the same rows and model, single
rows (pack false). Goal: at least 0.95.

    python -m bench.pipeline [--rows 200] [--repeats 3] [--model PATH]

The batch path runs in real web and engine processes; the bare loop runs in this process through
the production loader. The two alternate, so the ratio is of side-by-side medians.
"""

import argparse

GOAL = 0.95


def main(argv=None, running=None):
    """`running`: a stack of the same model to use instead of starting one."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    args = parser.parse_args(argv)

    from bench.common import (
        COMPLETIONS, check, interleaved_medians, load_resident, report, run_batch, scoring_lines, scoring_texts,
        setup_django, stack_for,
    )

    setup_django()
    import httpx
    import torch

    from inference_app.engine import services
    from inference_app.schemas import parse_request

    resident = load_resident(args.model)
    prompts = scoring_texts(resident, args.rows)
    lines = scoring_lines(resident.model_id, prompts)
    parsed = [parse_request(COMPLETIONS, {"model": resident.model_id, "prompt": p, "max_tokens": 1, "logprobs": 5}, True)
              for p in prompts]

    def bare():
        with torch.inference_mode():
            return [services.run(resident, row) for row in parsed]

    with stack_for(args.model, running) as running, httpx.Client(base_url=running.web.url, timeout=600) as client:
        run_batch(client, lines[:8])  # warm: first queries, first forward passes
        bare()
        seconds, results = interleaved_medians(
            {"bare": bare, "pipeline": lambda: run_batch(client, lines)}, args.repeats
        )
        batch, output = results["pipeline"]
        phases = phase_seconds(running, batch["id"])
    assert batch["request_counts"]["completed"] == args.rows and output.count(b"\n") == args.rows
    n = args.rows
    ratio = seconds["bare"] / seconds["pipeline"]
    figures = {
        "model": resident.model_id, "rows": n, "repeats": args.repeats,
        "bare_rows_per_s": n / seconds["bare"], "pipeline_rows_per_s": n / seconds["pipeline"], "ratio": ratio,
        "last_batch_phases_s": phases,
    }
    return report("pipeline", [
        ("model", f"{resident.model_id} ({resident.dtype_name}), {n} scoring rows of 10-60 tokens, single rows"),
        ("bare service loop", f"{figures['bare_rows_per_s']:.1f} rows/s"),
        ("batch path (upload to download)", f"{figures['pipeline_rows_per_s']:.1f} rows/s"),
        ("its phases (last run)", ", ".join(f"{name} {value:.2f} s" for name, value in phases.items())),
    ], figures, [check("batch path / bare loop", f"{ratio:.3f}", f">= {GOAL}", ratio >= GOAL)])


def phase_seconds(running, batch_id):
    """Where a batch's time went, from its recorded timestamps: created to in progress
    (validation), in progress to finalizing (rows), finalizing to completed (assembly)."""
    created, started, finalizing, completed = running.sql(
        "SELECT created_at, in_progress_at, finalizing_at, completed_at FROM batches_app_batch WHERE id = %s", [batch_id]
    )[0]
    return {
        "validate": (started - created).total_seconds(),
        "run": (finalizing - started).total_seconds(),
        "assemble": (completed - finalizing).total_seconds(),
    }


if __name__ == "__main__":
    main()
