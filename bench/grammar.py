"""grammar: what a grammar costs a decoded token (issue 29, point 2), side by side in one process.

The same chat prompts decoded with sampling (seeded), `--max-tokens` each, at width 1 (the
resident model's own loop) and at width `--width` (every prompt a seated sequence of the step
scheduler, as batched decoding runs rows), once unconstrained and once under a JSON schema
(`response_format` json_schema, each sequence its own grammar state); the end of sequence is
biased away on both sides so every row decodes its `--max-tokens`. Reports tokens per second
and the constrained / unconstrained ratio; the goal is at most 10% slower at the wider width.
Rounds are interleaved (bench.common.interleaved_medians).

    python -m bench.grammar [--width 16] [--max-tokens 64] [--repeats 3] [--model PATH]
"""

import argparse
import threading

# Long enough that an answer is not over in a few tokens: arrays of bounded strings and numbers.
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24}, "price": {"type": "number"},
            "kind": {"enum": ["fruit", "vegetable", "grain", "other"]}},
            "required": ["name", "price", "kind"], "additionalProperties": False}},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["items", "summary"],
    "additionalProperties": False,
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    args = parser.parse_args(argv)

    from bench.common import check, interleaved_medians, load_resident, report, setup_django

    setup_django()
    from inference_app.schemas import parse_request

    resident = load_resident(args.model)
    # Every row runs its max_tokens (the end of sequence biased away; a grammar still ends a
    # complete answer there, as its mask leaves nothing else), so both sides decode the same widths.
    no_end = {str(token): -100 for token in sorted(resident.eos_ids)}
    response_format = {"type": "json_schema", "json_schema": {"name": "groceries", "schema": SCHEMA, "strict": True}}
    requests = {
        constrained: [parse_request("/v1/chat/completions", {
            "model": resident.model_id, "messages": [{"role": "user", "content": f"List groceries for day {index}."}],
            "max_tokens": args.max_tokens, "temperature": 1.0, "seed": index, "logit_bias": no_end,
            **({"response_format": response_format} if constrained else {})}, strict=True).request
            for index in range(args.width)]
        for constrained in (False, True)
    }
    functions = {
        f"{label} at {width}": (lambda width=width, constrained=constrained: decode(resident, requests[constrained][:width]))
        for width in (1, args.width) for constrained, label in ((False, "unconstrained"), (True, "json_schema"))
    }
    seconds, produced = interleaved_medians(functions, args.repeats)
    rates = {name: sum(produced[name]) / seconds[name] for name in functions}
    figures = {"model": resident.model_id, "width": args.width, "max_tokens": args.max_tokens,
               "tokens_per_s": rates, "tokens": {name: sum(produced[name]) for name in functions}}
    rows = [("model", f"{resident.model_id} ({resident.dtype_name}), sampled (seeded), max_tokens {args.max_tokens}")]
    rows += [(name, f"{rates[name]:.1f} tokens/s ({sum(produced[name])} tokens)") for name in functions]
    checks = []
    for width in (1, args.width):
        ratio = rates[f"json_schema at {width}"] / rates[f"unconstrained at {width}"]
        figures[f"ratio_at_{width}"] = ratio
        rows.append((f"json_schema / unconstrained at {width}", f"{ratio:.2f}x"))
    wide = figures[f"ratio_at_{args.width}"]
    checks.append(check(f"tokens/s under a grammar at {args.width} rows", f"{wide:.2f}x of unconstrained", ">= 0.90x",
                        wide >= 0.90))
    return report("grammar", rows, figures, checks)


def decode(resident, requests):
    """Each request's tokens, its sequence under its own Controls (a grammar state when it has a
    response_format): one sequence alone through the resident model, several seated together."""
    from django.conf import settings

    from inference_app.engine.controls import Controls
    from inference_app.engine.scheduler import SeatedRuntime, StepScheduler

    def tokens(runtime, request):
        ids = resident.encode(resident.render_chat(request.messages))
        return len(list(runtime.generate(ids, request.max_tokens, request.temperature, request.top_p, request.seed,
                                         controls=Controls.of(request, resident))))

    if len(requests) == 1:
        return [tokens(resident, requests[0])]
    scheduler = StepScheduler(settings.ENGINE_PREFILL_TOKENS_PER_STEP)
    counts = [0] * len(requests)

    def consume(index):
        counts[index] = tokens(SeatedRuntime(resident, scheduler, interactive=False), requests[index])

    threads = [threading.Thread(target=consume, args=(index,)) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


if __name__ == "__main__":
    main()
