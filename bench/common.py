"""Shared pieces of the benchmarks: Django set-up, the model, timing, and the report."""

import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# The bench measures what `make run` serves: MILLM_DTYPE and MILLM_WEIGHTS as the environment
# sets them, `auto` when it does not (bfloat16 on a CPU with native bfloat16, packed quantized
# weights). The stacks it starts inherit them; each figure names its mode (`mode_of`). A check
# of a float32 promise (batched rows equal serial ones) is judged only where float32 ran
# (`exact_check`); `MILLM_DTYPE=float32 make bench` measures the float32 reference.


def setup_django():
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "millm_site.settings")
    import django

    django.setup()


def load_resident(model=None):
    """The model as the engine holds it, through the production loader."""
    from inference_app.catalogue import model_source
    from inference_app.engine.loader import load_model
    from inference_app.engine.runtime import ResidentModel

    return ResidentModel(load_model(model_source(model)))


def scoring_texts(resident, count, seed=7, shortest=10, longest=60):
    """Prompts of `shortest` to `longest` tokens (of the resident's tokenizer), in random order."""
    generator = random.Random(seed)
    # Whole words, in token-id order: get_vocab()'s own order changes from process to process (and
    # its entries carry the tokenizer's marks, "Ġword"), which drew a different file in every run.
    vocabulary = []
    for token_id in sorted(resident.tokenizer.get_vocab().values()):
        word = resident.tokenizer.decode([token_id]).strip()
        if word.isalpha() and word.isascii() and len(word) > 2:
            vocabulary.append(word)
        if len(vocabulary) == 5000:
            break

    def text_of(tokens):
        words = []
        while len(resident.encode(" ".join(words))) < tokens:
            words.append(generator.choice(vocabulary))
        return " ".join(words)

    return [text_of(generator.randint(shortest, longest)) for _ in range(count)]


@contextlib.contextmanager
def stack(model=None, **settings):
    """Real web and engine processes (tests/e2e/stack.py) on a database of their own, serving
    `model` (default: the packaged SmolLM2) under the id the in-process loader gives it. The
    GGUF conversion cache is shared, so a stack does not convert again."""
    from django.conf import settings as django_settings

    from inference_app.catalogue import model_source
    from tests.e2e.stack import Stack

    source = model_source(model)
    work = Path(tempfile.mkdtemp(prefix="millm-bench-"))
    cache = django_settings.MILLM_DATA_DIR / "model-cache"
    cache.mkdir(parents=True, exist_ok=True)
    (work / "data").mkdir()
    (work / "data" / "model-cache").symlink_to(cache)
    try:
        # The production heartbeat, not the end-to-end tests' fast one: the engine's own chatter
        # beside the model is part of what is measured.
        key = _stack_key(model, settings)
        settings = {"ENGINE_HEARTBEAT_S": 2, "ENGINE_STALE_S": 10, **settings}
        with Stack.running(work, source.path, MILLM_MODEL_ID=source.model_id, **settings) as running:
            _OPEN[key] = running
            try:
                yield running
            finally:
                _OPEN.pop(key, None)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_OPEN = {}  # (model, settings) -> the stack that `stack` started with them, while it runs


def _stack_key(model, settings):
    return str(model), tuple(sorted((name, str(value)) for name, value in settings.items()))


def stack_or_open(model=None, **settings):
    """A stack with these settings: one the suite already has open (the quick run shares its
    tiny stack this way), or a new one."""
    running = _OPEN.get(_stack_key(model, settings))
    return contextlib.nullcontext(running) if running is not None else stack(model, **settings)


def stack_for(model, running=None):
    """The stack a part runs on: the one the suite shares (`running`), or one of its own."""
    return contextlib.nullcontext(running) if running is not None else stack(model)


def percentile(values, share):
    """The nearest-rank percentile (share 0.5 is the median, 0.99 the 99th)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(share * len(ordered) + 0.5)) - 1))]


def rss_mb(pid, field="VmRSS"):
    """A process's resident memory (VmRSS) or its peak since the last reset (VmHWM), in MB."""
    for row in open(f"/proc/{pid}/status"):
        if row.startswith(field + ":"):
            return int(row.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def reset_peak(pid):
    """Linux: writing 5 to clear_refs resets VmHWM, so the next peak is this operation's."""
    with open(f"/proc/{pid}/clear_refs", "w") as handle:
        handle.write("5")


def check(figure, value, goal, met):
    """One figure beside its goal, for the summary table."""
    return {"figure": figure, "value": value, "goal": goal, "met": bool(met)}


_MODES = {}  # (model, dtype, weights) -> mode, so each is loaded once a run


def mode_of(model=None, dtype=None, weights=None):
    """The mode a part's engine runs in, as its fingerprint names it (`bfloat16/Q4_1+packed`,
    `float32/none`): `model` (default: the packaged one) loaded through the production loader
    with these settings (default: the environment's, as the stacks get them)."""
    key = (str(model), dtype, weights)
    if key not in _MODES:
        from inference_app.catalogue import model_source
        from inference_app.engine.loader import load_model, pick_device, pick_dtype, pick_weights
        from inference_app.engine.runtime import ResidentModel

        device = pick_device()
        resident = ResidentModel(load_model(model_source(model), device, pick_dtype(device, dtype),
                                            pick_weights(device, weights, dtype)))
        _MODES[key] = resident.fingerprint.rsplit(":", 2)[1]
        del resident
    return _MODES[key]


def exact_check(figure, value, goal, met, dtype):
    """A float32 promise (the same tokens either way): judged where float32 ran; in bfloat16 the
    figure is reported beside the goal without a verdict (near-ties may part, SPEC 7a)."""
    if dtype == "float32":
        return check(figure, value, goal, met)
    return {**check(figure, value, f"{goal} (a float32 promise; not judged in {dtype})", True), "met": None}


def interleaved_medians(functions, repeats):
    """Run each function once per round, `repeats` rounds, and return each one's median seconds
    and last result. Interleaving keeps a shared machine's drift out of the ratios."""
    timings = {name: [] for name in functions}
    results = {}
    for _ in range(repeats):
        for name, function in functions.items():
            started = time.perf_counter()
            results[name] = function()
            timings[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in timings.items()}, results


def machine():
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


VERDICTS = {True: "met", False: "MISSED", None: "not judged"}


def report(name, rows, figures, checks=()):
    """Print a table (each goal beside its figure) and write bench/results/<name>.json."""
    figures = {**figures, "checks": list(checks), "report": [list(row) for row in rows]}
    rows = list(rows) + [(c["figure"], f"{c['value']}   goal {c['goal']}: {VERDICTS[c['met']]}") for c in checks]
    width = max(len(label) for label, _ in rows)
    print(f"\n{name}")
    for label, value in rows:
        print(f"  {label.ljust(width)}  {value}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"name": name, "machine": machine(), "figures": figures}, indent=2))
    print(f"  (written to {path.relative_to(ROOT)})")
    return figures


COMPLETIONS = "/v1/completions"
FINISHED = {"completed", "failed", "expired", "cancelled"}


def scoring_lines(model_id, prompts, logprobs=5):
    """A batch file's lines: one scoring row (max_tokens 1, logprobs) per prompt."""
    return [
        json.dumps({"custom_id": f"row-{index}", "method": "POST", "url": COMPLETIONS,
                    "body": {"model": model_id, "prompt": prompt, "max_tokens": 1, "logprobs": logprobs}})
        for index, prompt in enumerate(prompts)
    ]


def start_batch(client, lines, endpoint=COMPLETIONS, **create):
    """Upload `lines` (JSON strings) and create a batch on them; returns the batch object."""
    body = ("\n".join(lines) + "\n").encode()
    uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("input.jsonl", body)})
    uploaded.raise_for_status()
    created = client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": endpoint,
                                               "completion_window": "24h", **create})
    created.raise_for_status()
    return created.json()


def wait_batch(client, batch_id, poll_s=0.25, timeout=3600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in FINISHED:
            return batch
        time.sleep(poll_s)
    raise TimeoutError(f"batch {batch_id} did not finish in {timeout} s")


def run_batch(client, lines, endpoint=COMPLETIONS, poll_s=0.25):
    """The whole batch path as a user drives it: upload, create, poll every `poll_s` until it
    ends, download the output. Returns (the finished batch, the output bytes)."""
    batch = wait_batch(client, start_batch(client, lines, endpoint)["id"], poll_s)
    if batch["status"] != "completed":
        raise RuntimeError(f"batch {batch['id']} ended {batch['status']}: {batch.get('errors')}")
    output = client.get(f"/v1/files/{batch['output_file_id']}/content").content if batch["output_file_id"] else b""
    return batch, output


def tiny_model():
    """The tests' tiny random Llama (made once by createtestmodel): where the model is nearly free.
    From tests/model_files.py, not conftest.py, whose import would pin the suite's float32 on
    every part (as it did on every `make bench` before 2026-12-05)."""
    from tests.model_files import build_test_model

    return build_test_model()


CHAT = "/v1/chat/completions"


def chat_body(model_id, text, max_tokens, temperature=0):
    """One user message, greedy by default: the same answer from any server of the same model."""
    return {"model": model_id, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": temperature}


def chat_lines(model_id, prompts, max_tokens):
    """A batch file's lines: one greedy generation row (/v1/chat/completions) per prompt."""
    return [json.dumps({"custom_id": f"row-{index}", "method": "POST", "url": CHAT,
                        "body": chat_body(model_id, prompt, max_tokens)})
            for index, prompt in enumerate(prompts)]


def start_batch_unless_refused(client, lines, endpoint, field, **create):
    """start_batch, except that a 400 naming `field` (a create field this server does not know
    yet, such as batched_decoding before the step scheduler) returns (None, the refusal's
    message) instead of raising; any other error raises. Returns (batch, None) otherwise."""
    import httpx

    try:
        return start_batch(client, lines, endpoint, **create), None
    except httpx.HTTPStatusError as error:
        body = error.response.json() if error.response.headers.get("content-type", "").startswith("application/json") else {}
        if error.response.status_code == 400 and body.get("error", {}).get("param") == field:
            return None, body["error"]["message"]
        raise


def output_rows(client, batch):
    """A finished batch's output file, parsed: custom_id -> its output line."""
    if not batch.get("output_file_id"):
        return {}
    content = client.get(f"/v1/files/{batch['output_file_id']}/content").content
    lines = [json.loads(line) for line in content.splitlines() if line.strip()]
    return {line["custom_id"]: line for line in lines}


def first_difference(left, right):
    """The index of the first item where two sequences differ (the shorter one's length when
    one is a prefix of the other), or None when they are the same."""
    for index, (a, b) in enumerate(zip(left, right)):
        if a != b:
            return index
    return None if len(left) == len(right) else min(len(left), len(right))


def default_gguf(model=None):
    """The GGUF file `model` (a MILLM_MODEL value; None: the packaged SmolLM2) comes from, or
    the packaged one when `model` is a folder of safetensors: what another server can load."""
    from inference_app.catalogue import default_model_path, model_source

    source = model_source(model)
    return source.path if source.path.suffix.lower() == ".gguf" else default_model_path()
