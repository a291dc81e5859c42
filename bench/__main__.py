"""Every benchmark part in one run: a table of each figure beside its goal, JSON under
bench/results/, the README's results section and the packing chart (docs/bench/packing.png).

    python -m bench [PART ...] [--quick] [--no-readme] [--model PATH [--chat-template NAME]]

PART is any of PARTS below (default: all, in that order). --quick runs each at a tiny size on the
tiny test model (what the smoke test runs): the figures say nothing then, so --quick never
rewrites the README. concurrency's llama.cpp baseline needs the bench extra's xllamacpp.
--model (and --chat-template, for a file without one) runs the peers part on another model, the
model a user brings (`make bench PARTS="peers --model var/test-models/gemma-3-270m-q4_k_m.gguf
--chat-template gemma"`); the other parts keep their models, and such a run leaves the README alone.
"""

import argparse
import contextlib
import datetime
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback

from bench.common import RESULTS, ROOT, machine

PARTS = ["pipeline", "overhead", "interactive", "interactive-batched", "roundtrip", "packing", "memory", "generation",
         "concurrency", "decoders", "grammar", "cpu_levers", "retention", "replicas", "peers", "prefix"]
RUN_ORDER = ["pipeline", "interactive", "interactive-batched", "generation", "retention", "concurrency", "peers", "prefix",
             "replicas",
             "overhead", "roundtrip", "memory", "packing", "decoders", "grammar", "cpu_levers"]
# The model of each part's web and engine processes in the full run (--quick: all tiny). Not
# concurrency: it starts its own stacks (two engine settings) and llama.cpp, one at a time, so
# it runs after the default model's stack is stopped and before the tiny one starts; nor
# replicas, which starts its own two stacks (one replica, then two) of the tiny model.
STACK_MODEL = {"pipeline": "default", "interactive": "default", "interactive-batched": "default", "generation": "default",
               "retention": "default", "overhead": "tiny", "roundtrip": "tiny", "memory": "tiny"}
# The model of every other part's engine, for the mode each row names (the in-process parts load
# the packaged model unless told otherwise); peers and prefix set MILLM_DTYPE and MILLM_WEIGHTS
# to `auto` themselves (SETTINGS), whatever the environment says.
TINY_PARTS = {"overhead", "roundtrip", "memory", "replicas"}
AUTO_PARTS = {"peers", "prefix"}
# A part that is another part's module with other arguments (see sizes()), and its name in the table.
MODULE = {"interactive-batched": "interactive"}
LABEL = {"interactive-batched": "interactive (batched decoding)"}
# Parts timed in a process of their own: in-process model runs are sensitive to what ran before
# them (the packing ratio measured 1.6-1.7x after the other parts, about 1.9x alone).
FRESH_PROCESS = {"packing", "decoders", "grammar", "cpu_levers"}
# --quick proves the parts run, so it spares what only timing needs: the fresh processes, and a
# stack of its own for the concurrency part's default engine (the shared tiny stack admits as
# many waiting chats as that part sends; bench.common.stack_or_open finds it).
QUICK_SHARED = {"MAX_PENDING_REQUESTS": 64}
CHART = ROOT / "docs" / "bench" / "packing.png"
README = ROOT / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"


def sizes(part, quick, tiny):
    """Each part's arguments: the full run's, or tiny ones that only prove the part still works."""
    if not quick:
        return {
            "pipeline": ["--rows", "200", "--repeats", "3"],
            "overhead": ["--rows", "50000", "--sample", "2000"],
            "interactive": ["--requests", "40", "--batch-rows", "3000"],
            "interactive-batched": ["--requests", "40", "--batch-rows", "1000", "--batched-decoding"],
            "roundtrip": ["--requests", "300"],
            "packing": ["--rows", "256", "--repeats", "3"],
            "memory": ["--upload-mb", "200", "--lines", "50000"],
            "generation": ["--rows", "64", "--max-tokens", "64"],
            "concurrency": ["--chats", "8", "32", "--max-tokens", "64"],
            "decoders": ["--prompts", "16", "--max-tokens", "64"],
            "grammar": ["--width", "16", "--max-tokens", "64", "--repeats", "3"],
            "cpu_levers": ["--max-tokens", "64", "--repeats", "3"],
            "retention": ["--rows", "10000"],
            "replicas": ["--rows", "240", "--max-tokens", "16", "--scoring-rows", "1200", "--repeats", "3"],
            "peers": ["--modes", "auto", "--repeats", "3"],
            "prefix": ["--repeats", "3"],
        }[part]
    model = ["--model", tiny]
    return {
        "pipeline": ["--rows", "8", "--repeats", "1", *model],
        "overhead": ["--rows", "40", "--sample", "8", *model],
        "interactive": ["--requests", "3", "--batch-rows", "400", "--max-tokens", "2", "--rate-seconds", "0.5", *model],
        "interactive-batched": ["--requests", "3", "--batch-rows", "1000", "--max-tokens", "2", "--batch-max-tokens", "8",
                                "--batched-decoding", *model],
        "roundtrip": ["--requests", "25", *model],
        "packing": ["--rows", "6", "--repeats", "1", "--window", "4", *model],
        "memory": ["--upload-mb", "2", "--lines", "40", *model],
        "generation": ["--rows", "4", "--max-tokens", "16", *model],
        "concurrency": ["--chats", "2", "4", "--max-tokens", "4", *model],
        "decoders": ["--prompts", "3", "--max-tokens", "4", *model],
        "grammar": ["--width", "2", "--max-tokens", "4", "--repeats", "1", *model],
        "cpu_levers": ["--max-tokens", "4", "--width", "2", "--repeats", "1", "--only", "threads=1", "int8_dynamic", *model],
        "retention": ["--rows", "20", *model],
        "replicas": ["--rows", "8", "--max-tokens", "4", "--scoring-rows", "32", "--repeats", "1", "--wait-poll-s", "0.1",
                     *model],
        "peers": ["--modes", "--repeats", "1", "--one-chat-tokens", "4", "--chat-tokens", "4", "--generation-rows", "4",
                  "--scoring-rows", "8", "--embedding-inputs", "8", *model],
        "prefix": ["--repeats", "1", "--scoring-rows", "8", "--instruction-tokens", "40", "--generation-rows", "4",
                   "--system-tokens", "40", "--max-tokens", "4", "--turn-tokens", "4", "--quality-rows", "4", *model],
    }[part]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("parts", nargs="*", metavar="PART", help=f"any of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes on the tiny model: proves the parts run")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md and the chart alone")
    parser.add_argument("--model", default=None, help="the peers part's model (a .gguf); default the packaged one")
    parser.add_argument("--chat-template", default=None, help="the peers part's template, for a file without one")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    parts = args.parts or PARTS
    from bench.common import setup_django, stack, tiny_model

    setup_django()
    tiny = str(tiny_model())
    started = time.monotonic()
    results = {}
    # Parts run grouped by the stack they use, each stack stopped once its last part is done, so
    # no idle engine runs beside a later part (packing, in a process of its own, runs last, alone).
    ordered = sorted(parts, key=lambda part: RUN_ORDER.index(part))
    model_of = {part: (tiny if args.quick or STACK_MODEL[part] == "tiny" else None) for part in ordered if part in STACK_MODEL}
    with contextlib.ExitStack() as stacks:
        shared = {}  # model -> (its stack, the ExitStack that stops it)
        for index, part in enumerate(ordered):
            module = importlib.import_module(f"bench.{MODULE.get(part, part)}")
            part_started = time.monotonic()
            kwargs = {}
            if part in model_of:
                model = model_of[part]
                if model not in shared:
                    own = stacks.enter_context(contextlib.ExitStack())
                    shared[model] = (own.enter_context(stack(model, **(QUICK_SHARED if args.quick else {}))), own)
                kwargs["running"] = shared[model][0]
            arguments = sizes(part, args.quick, tiny)
            if part == "peers" and args.model:
                arguments += ["--model", args.model] + (["--chat-template", args.chat_template] if args.chat_template else [])
            try:
                if part in FRESH_PROCESS and not args.quick:
                    results[part] = in_fresh_process(part, arguments)
                else:
                    results[part] = module.main(arguments, **kwargs)
            except Exception as error:
                if args.quick:
                    raise  # the smoke test: a part that fails, fails it
                traceback.print_exc()
                results[part] = failed(error)
            results[part]["seconds"] = round(time.monotonic() - part_started, 1)
            results[part]["mode"] = part_mode(part, tiny if args.quick or part in TINY_PARTS else args.model if part == "peers" else None)
            if part in model_of and model_of[part] not in [model_of.get(later) for later in ordered[index + 1:]]:
                shared[model_of[part]][1].close()
    results = {part: results[part] for part in PARTS if part in results}
    summary = {
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(),
        "seconds": round(time.monotonic() - started, 1),
        "quick": args.quick,
        "parts": results,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    table = render(summary)
    print("\n" + table)
    if "packing" in results:
        chart(results["packing"], RESULTS / "packing.png" if args.quick or args.no_readme else CHART)
    if not (args.quick or args.no_readme or args.model) and set(parts) == set(PARTS):
        write_readme(table)
    return summary


def part_mode(part, model):
    """The dtype and weights the part's engine ran (`bfloat16/Q4_1+packed`), as its fingerprint says."""
    from bench.common import mode_of

    return mode_of(model, *(("auto", "auto") if part in AUTO_PARTS else ()))


def failed(error):
    """A part that raised, as its row of the table: the rest of a full run goes on (a peer's
    server that drops a connection half an hour in cost a whole run's table once)."""
    reason = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"
    return {"checks": [{"figure": "the part", "value": f"failed ({reason})", "goal": "runs to its end", "met": False}],
            "report": [("failed", reason)]}


def in_fresh_process(part, arguments):
    """Run `python -m bench.<part>` and read back the figures it wrote."""
    subprocess.run([sys.executable, "-m", f"bench.{part}", *arguments], cwd=ROOT, check=True)
    return json.loads((RESULTS / f"{part}.json").read_text())["figures"]


def describe_machine():
    cpu = platform.processor() or platform.machine()
    try:
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    return {**machine(), "cpu": cpu, "memory_gb": round(memory_gb, 1), "os": platform.platform(terse=True)}


def render(summary):
    """The results table in Markdown: every figure beside its goal, with the part's sizes."""
    m = summary["machine"]
    lines = [
        f"Measured {summary['date']} by `make bench` ({summary['seconds'] / 60:.1f} minutes) on {m['cpu']}, "
        f"{m['cores']} cores ({m['threads']} torch threads), {m['memory_gb']} GiB, {m['os']}, "
        f"Python {m['python']}, torch {m['torch']}, CPU only.",
        "",
        "Each row names the mode its engine ran: dtype / the weights' quantization, `+packed` where the",
        "quantized projections ran from their packed blocks (the default is `MILLM_DTYPE=auto`,",
        "`MILLM_WEIGHTS=auto`, what `make run` serves).",
        "",
        "| part | mode | figure | measured | goal | |",
        "|---|---|---|---|---|---|",
    ]
    for part, figures in summary["parts"].items():
        for item in figures.get("checks", []):
            verdict = {True: "met", False: "**missed**", None: "–"}[item["met"]]
            mode = f"`{figures['mode']}`" if figures.get("mode") else "?"
            lines.append(f"| {LABEL.get(part, part)} | {mode} | {item['figure']} | {item['value']} | {item['goal']} | {verdict} |")
    lines += ["", "| part | sizes and the figures behind the ratios |", "|---|---|"]
    for part, figures in summary["parts"].items():
        detail = "; ".join(f"{label}: {value}" for label, value in figures.get("report", []))
        lines.append(f"| {LABEL.get(part, part)} ({figures.get('seconds', '?')} s) | {detail.replace('|', '/')} |")
    return "\n".join(lines)


def chart(figures, path):
    """Rows per second for single rows, packed in file order, and length-aware packing."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    labels = ["single rows", "packed, file order", "packed, length-aware"]
    values = [figures["single_rows_per_s"], figures["packed_file_order_rows_per_s"], figures["packed_length_aware_rows_per_s"]]
    figure, axes = pyplot.subplots(figsize=(6.4, 3.2), dpi=100)
    bars = axes.bar(labels, values, color=["#8c8c8c", "#6a9fd4", "#2f6db5"])
    for bar, value in zip(bars, values):
        axes.annotate(f"{value:.1f} ({value / values[0]:.2f}x)", (bar.get_x() + bar.get_width() / 2, value),
                      ha="center", va="bottom", fontsize=9)
    axes.set_ylabel("rows per second")
    axes.set_title(f"Scoring rows, {figures['model']} ({figures['dtype']}), packs of {figures['pack_rows']}", fontsize=9)
    axes.set_ylim(0, max(values) * 1.2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    pyplot.close(figure)
    print(f"chart written to {path.relative_to(ROOT)}")


def write_readme(table):
    text = README.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"README.md has no {START} ... {END} section to write the results into")
    block = f"{START}\n{table}\n\n![Scoring rows per second](docs/bench/packing.png)\n{END}"
    README.write_text(re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S))
    print("README.md results section rewritten")


if __name__ == "__main__":
    main()
