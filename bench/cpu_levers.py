"""cpu_levers: decode speed on this CPU, lever by lever (issue 14, point 6; issue 27: at width
1 and width 16).

One greedy chat of `--max-tokens` tokens through the resident model's own loop
(`ResidentModel.generate`), in this process, after a warm-up, and --width greedy chats decoded
together through the scheduler's `BatchedDecoder` (each prefilled alone, one forward pass a
step), with:
- `baseline`: float32, torch's default threads;
- `threads=N`: `torch.set_num_threads(N)` for each N in 1..cores;
- `int8_dynamic`: `torch.ao.quantization.quantize_dynamic` on every `nn.Linear` (int8 weights,
  activations quantized per call: changes the numbers, so it could only ever be a setting);
- `bfloat16`: the model cast to bfloat16 (changes the numbers);
- `compile`: `torch.compile` of the model's forward (same numbers up to kernel order), timed
  after its compile;
- `onednn_linear`: float32 linears run through oneDNN's `torch.ops.mkldnn` path
  (`torch.utils.mkldnn.to_mkldnn`), where this torch build offers it;
- `packed`: a GGUF's Q4_0/Q4_1/Q8_0 projections through torch's int4 kernel at every width
  (MILLM_WEIGHTS=quantized); `packed_auto`: where the kernel timed faster (MILLM_WEIGHTS=auto).

Each lever reports tokens/s, its ratio to the baseline and whether its tokens equal the
baseline's. A lever that fails reports why and the part goes on.

    python -m bench.cpu_levers [--max-tokens 64] [--width 16] [--repeats 3] [--model PATH] [--only NAME ...]
"""

import argparse
import copy
import os
import statistics
import time
from pathlib import Path


def main(argv=None, running=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=16, help="chats decoded together in the second figure")
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    parser.add_argument("--only", nargs="*", default=None, help="levers to run (default: all)")
    args = parser.parse_args(argv)

    from bench.common import check, load_resident, report, setup_django

    setup_django()
    import torch

    resident = load_resident(args.model)
    chat = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
    prompt = resident.encode(resident.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    default_threads = torch.get_num_threads()

    def tokens_per_s():
        list(resident.generate(prompt, 4, 0.0, 1.0, 0))  # warm
        timings, tokens = [], None
        for _ in range(args.repeats):
            started = time.perf_counter()
            tokens = [token.token_id for token in resident.generate(prompt, args.max_tokens, 0.0, 1.0, 0)]
            timings.append(time.perf_counter() - started)
        return len(tokens) / statistics.median(timings), tokens

    prompts = [resident.encode(resident.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a short story about a lighthouse keeper, number {row}."}],
        tokenize=False, add_generation_prompt=True)) for row in range(args.width)]

    def wide_tokens_per_s():
        """--width chats decoded together: (tokens/s over every row, each row's tokens)."""
        from inference_app.engine.decoding import BatchedDecoder

        timings, rows = [], None
        for _ in range(args.repeats):
            started = time.perf_counter()
            decoder, rows = BatchedDecoder(resident), []
            for prompt_ids in prompts:
                cache, logits = decoder.prefill(prompt_ids)
                decoder.admit(cache, len(prompt_ids))
                rows.append([int(torch.argmax(logits))])
            for _ in range(args.max_tokens - 1):
                logits = decoder.step([row[-1] for row in rows])
                for row, token in zip(rows, torch.argmax(logits, dim=-1).tolist()):
                    row.append(token)
            timings.append(time.perf_counter() - started)
        return sum(len(row) for row in rows) / statistics.median(timings), rows

    levers = {"baseline": lambda model: model}
    for count in range(1, (os.cpu_count() or 1) + 1):
        if count != default_threads:
            levers[f"threads={count}"] = _threads(count)
    levers.update({"int8_dynamic": _int8_dynamic, "bfloat16": _bfloat16, "compile": _compile,
                   "onednn_linear": _onednn_linear, "packed": _packed(resident, "quantized"),
                   "packed_auto": _packed(resident, "auto")})
    original = resident.model
    outcomes = {}
    for name, lever in levers.items():
        if args.only is not None and name not in args.only and name != "baseline":
            continue
        try:
            resident.serve(lever(copy.deepcopy(original) if name != "baseline" else original))
            speed, tokens = tokens_per_s()
            wide, rows = wide_tokens_per_s()
            outcomes[name] = {"tokens_per_s": speed, "tokens": tokens, "wide_tokens_per_s": wide, "rows": rows}
        except Exception as error:  # a lever this build lacks is a finding, not a failure
            outcomes[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        finally:
            resident.serve(original)
            torch.set_num_threads(default_threads)

    base = outcomes["baseline"]
    rows = [("model", f"{resident.model_id} ({resident.dtype_name}), one chat and {args.width} together, "
                      f"{args.max_tokens} tokens, greedy, {default_threads} threads by default")]
    figures = {"model": resident.model_id, "max_tokens": args.max_tokens, "width": args.width,
               "default_threads": default_threads}
    for name, outcome in outcomes.items():
        if "error" in outcome:
            rows.append((name, f"not available: {outcome['error']}"))
            figures[name] = outcome
            continue
        same = outcome["tokens"] == base["tokens"]
        ratio = outcome["tokens_per_s"] / base["tokens_per_s"]
        wide_ratio = outcome["wide_tokens_per_s"] / base["wide_tokens_per_s"]
        same_rows = sum(mine == theirs for mine, theirs in zip(outcome["rows"], base["rows"]))
        figures[name] = {"tokens_per_s": outcome["tokens_per_s"], "ratio": ratio, "same_tokens": same,
                         "wide_tokens_per_s": outcome["wide_tokens_per_s"], "wide_ratio": wide_ratio,
                         "wide_same_rows": same_rows}
        rows.append((name, f"{outcome['tokens_per_s']:.1f} tokens/s ({ratio:.2f}x), "
                           f"{'the same tokens' if same else 'other tokens'}; {args.width} together "
                           f"{outcome['wide_tokens_per_s']:.1f} tokens/s ({wide_ratio:.2f}x), {same_rows} of "
                           f"{args.width} rows the same"))
    keeping = {name: figures[name]["ratio"] for name in outcomes
               if name != "baseline" and "error" not in outcomes[name] and figures[name]["same_tokens"]}
    best = max(keeping, key=keeping.get) if keeping else None
    ratio = keeping.get(best, 1.0)
    checks = [check("fastest lever with the same tokens / the engine's default", f"{ratio:.2f}x ({best})",
                    "<= 1.05 (else adopt it)", ratio <= 1.05)]
    return report("cpu_levers", rows, figures, checks)


def _packed(resident, mode):
    def apply(model):
        from inference_app.engine import quantized
        from inference_app.models import ModelEntry

        source = resident.loaded.source
        if source.format != ModelEntry.Format.GGUF:
            raise RuntimeError(f"{resident.model_id} is not a GGUF: nothing is packed")
        quantized.pack(model, source.path, mode, cache=Path(resident.model.name_or_path) / "millm-blocks.safetensors")
        return model

    return apply


def _threads(count):
    def apply(model):
        import torch

        torch.set_num_threads(count)
        return model

    return apply


def _int8_dynamic(model):
    import torch

    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def _bfloat16(model):
    import torch

    return model.to(torch.bfloat16)


def _compile(model):
    import torch

    model.forward = torch.compile(model.forward, dynamic=True)
    return model


def _onednn_linear(model):
    import torch

    if not torch.backends.mkldnn.is_available():
        raise RuntimeError("this torch build has no oneDNN (mkldnn)")
    from torch.utils import mkldnn as mkldnn_utils

    return mkldnn_utils.to_mkldnn(model)


if __name__ == "__main__":
    main()
