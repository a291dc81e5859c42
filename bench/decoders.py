"""decoders: library or hand-written, measured side by side in one process (issue 14, point 5).

The same greedy prompts (chat-rendered, `--prompts` of them, `--max-tokens` new tokens each)
through:
- `serial`: the resident model's own one-sequence-at-a-time loop (`ResidentModel.generate`);
- `scheduler`: our step scheduler, every prompt a seated consumer in a thread of its own, as the
  engine serves concurrent chats and `batched_decoding` rows;
- `transformers_cb`: transformers' own continuous-batching manager (`model.generate_batch`, paged
  cache, its own scheduler);
- `hf_generate`: transformers `generate` on all prompts at once, left-padded (no joins or leaves).

Each reports tokens/s and how many prompts give the serial loop's tokens exactly (and, for the
others, the first token index where they part).

    python -m bench.decoders [--prompts 16] [--max-tokens 64] [--model PATH]
"""

import argparse
import threading
import time

from bench.common import first_difference


def main(argv=None, running=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    parser.add_argument("--skip", nargs="*", default=[], help="decoders to leave out")
    args = parser.parse_args(argv)

    from bench.common import exact_check, load_resident, report, scoring_texts, setup_django

    setup_django()
    resident = load_resident(args.model)
    chats = [[{"role": "user", "content": text}] for text in scoring_texts(resident, args.prompts, 11, 8, 40)]
    prompts = [resident.encode(resident.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
               for chat in chats]
    decoders = {"serial": serial, "scheduler": scheduler, "transformers_cb": transformers_cb, "hf_generate": hf_generate}
    outcomes = {}
    for name, decode in decoders.items():
        if name in args.skip:
            continue
        decode(resident, prompts[:2], 4)  # warm
        started = time.perf_counter()
        tokens = decode(resident, prompts, args.max_tokens)
        seconds = time.perf_counter() - started
        outcomes[name] = {"seconds": seconds, "tokens": tokens,
                          "tokens_per_s": sum(len(row) for row in tokens) / seconds}
    reference = outcomes["serial"]["tokens"]
    figures = {"model": resident.model_id, "prompts": len(prompts), "max_tokens": args.max_tokens}
    rows = [("model", f"{resident.model_id} ({resident.dtype_name}), {len(prompts)} prompts, {args.max_tokens} tokens, greedy")]
    for name, outcome in outcomes.items():
        same, parted = compare(reference, outcome["tokens"])
        figures[name] = {"tokens_per_s": outcome["tokens_per_s"], "seconds": outcome["seconds"], "same_rows": same,
                         "first_differing_token": parted}
        ratio = outcome["tokens_per_s"] / outcomes["serial"]["tokens_per_s"]
        rows.append((name, f"{outcome['tokens_per_s']:.1f} tokens/s ({ratio:.2f}x serial), {same}/{len(prompts)} rows "
                           f"the serial tokens" + (f", others part at tokens {parted}" if parted else "")))
    checks = []
    if "scheduler" in figures:
        mine = figures["scheduler"]
        checks.append(exact_check("scheduler rows equal to serial", f"{mine['same_rows']}/{len(prompts)}", "all",
                                  mine["same_rows"] == len(prompts), resident.dtype_name))
    return report("decoders", rows, figures, checks)


def compare(reference, tokens):
    """(rows equal to the reference, [the first token index where each other row parts])."""
    parted = [first_difference(expected, got) for expected, got in zip(reference, tokens)]
    return parted.count(None), [index for index in parted if index is not None]


def serial(resident, prompts, max_tokens):
    return [[token.token_id for token in resident.generate(ids, max_tokens, 0.0, 1.0, 0)] for ids in prompts]


def scheduler(resident, prompts, max_tokens):
    from django.conf import settings

    from inference_app.engine.scheduler import SeatedRuntime, StepScheduler

    decoder = StepScheduler(settings.ENGINE_PREFILL_TOKENS_PER_STEP)
    results = [None] * len(prompts)

    def consume(index):
        seated = SeatedRuntime(resident, decoder, interactive=True)
        results[index] = [token.token_id for token in seated.generate(prompts[index], max_tokens, 0.0, 1.0, 0)]

    threads = [threading.Thread(target=consume, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


PAGE = 256  # tokens of one paged-cache block


def transformers_cb(resident, prompts, max_tokens):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from inference_app.engine import attention

    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(resident.eos_ids),
                              pad_token_id=resident.tokenizer.pad_token_id or 0)
    # The paged cache sized to the work, as a user sets it: left to itself the manager reserves
    # 90% of free memory (11 GB here), which took 12 of the 13 seconds of 3 prompts of 4 tokens.
    cache = ContinuousBatchingConfig(page_size=PAGE, num_blocks=sum(-(-(len(prompt) + max_tokens) // PAGE) for prompt in prompts) + 1,
                                     max_batch_tokens=max(PAGE, sum(len(prompt) for prompt in prompts)))
    # The manager takes only its own attention kinds: the engine's `millm_sdpa` (bfloat16 on a
    # CPU, attention.py) is SDPA with float32 scores, so the manager runs torch's SDPA meanwhile.
    model = resident.model
    own = model.config._attn_implementation
    if own == attention.NAME:
        model.set_attn_implementation("sdpa")
    try:
        outputs = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cache,
                                       progress_bar=False, warmup=False)
    finally:
        if own == attention.NAME:
            model.set_attn_implementation(own)
    by_prompt = sorted(outputs.values(), key=lambda output: int(str(output.request_id).rsplit("_", 1)[-1]))
    return [_until_eos(resident, list(output.generated_tokens)) for output in by_prompt]


def hf_generate(resident, prompts, max_tokens):
    import torch

    width = max(len(ids) for ids in prompts)
    pad = resident.tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in prompts])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in prompts])
    with torch.inference_mode():
        out = resident.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                      eos_token_id=sorted(resident.eos_ids), pad_token_id=pad)
    return [_until_eos(resident, row[width:].tolist()) for row in out]


def _until_eos(resident, tokens):
    """As the serial loop yields them: up to and including the first EOS."""
    for index, token in enumerate(tokens):
        if resident.is_eos(token):
            return tokens[: index + 1]
    return tokens


if __name__ == "__main__":
    main()
