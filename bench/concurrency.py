"""concurrency: many chats at once (8, then 32), each level measured on three servers of the
same model, one at a time: miServer (ENGINE_MAX_SEQUENCES at its default), miServer with
ENGINE_MAX_SEQUENCES=1 (one sequence at a time, the engine before the step scheduler), and
llama.cpp's own server (the xllamacpp wheel) on the GGUF file the model comes from, with as
many parallel slots as chats. Figures: aggregate completion tokens per second (all chats'
usage.completion_tokens over the wall time from the first request to the last answer) and p50 /
p99 latency. Goals at the first level (8 chats): miServer's tokens per second at least
llama.cpp's, and its p50 at most half the one-sequence engine's.

    python -m bench.concurrency [--chats 8 32] [--max-tokens 64] [--rounds 1] [--model PATH]

Every chat is greedy (temperature 0), not streamed, with a prompt of its own. Each client sends
--rounds chats one after another; all clients start together. Without xllamacpp installed the
part says so and goes on with the two miServer figures.
"""

import argparse
import collections
import concurrent.futures
import contextlib
import subprocess
import sys
import tempfile
import threading
import time

# Each stack admits every chat: ENGINE_MAX_SEQUENCES=1 refuses past MAX_PENDING_REQUESTS waiting.
MAX_PENDING = 64
SUBJECTS = ["a lighthouse", "the river", "a small robot", "winter", "the market", "a violin", "the moon",
            "an old map", "bread", "the train", "a garden", "the storm", "a clock", "the desert", "a letter",
            "the forest"]
# llama.cpp's server in a process of its own: the model and its threads gone when it ends.
SERVE = """
import sys
import xllamacpp

path, port, slots, context, threads = sys.argv[1], *map(int, sys.argv[2:6])
embedding, template = sys.argv[6], sys.argv[7]
params = xllamacpp.CommonParams()
params.embedding = embedding == "embedding"
if template:  # one of llama.cpp's built-in templates by name, as miServer's MILLM_CHAT_TEMPLATE
    params.chat_template = template
if params.embedding:  # mean pooling, as miServer's embeddings default to
    params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN
params.model.path = path
params.hostnames = ["127.0.0.1"]
params.port = port
params.n_parallel = slots
params.n_ctx = slots * context
params.cpuparams.n_threads = threads
params.cpuparams_batch.n_threads = threads
server = xllamacpp.Server(params)
print(server.listening_address, flush=True)
sys.stdin.read()
"""


def main(argv=None):
    """Starts its own stacks (and llama.cpp), one at a time, so that nothing idles beside them."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chats", type=int, nargs="+", default=[8, 32], help="the levels of concurrent chats")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="chats each client sends, one after another")
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    parser.add_argument("--time-limit", type=float, default=900, help="seconds one level may take on one server")
    args = parser.parse_args(argv)

    from bench.common import check, default_gguf, report, setup_django, stack_or_open

    setup_django()
    import importlib.metadata
    import importlib.util

    import torch

    from inference_app.catalogue import model_source

    servers = {}  # label -> {level: figures}
    labels = {"miserver": "miServer", "serial": "ENGINE_MAX_SEQUENCES=1"}
    for label, settings in [("miserver", {}), ("serial", {"ENGINE_MAX_SEQUENCES": 1})]:
        with stack_or_open(args.model, MAX_PENDING_REQUESTS=MAX_PENDING, **settings) as running:
            servers[label] = {level: measure(running.web.url, running.model_id, level, args) for level in args.chats}
    gguf = default_gguf(args.model)
    elsewhere = "" if model_source(args.model).path == gguf else " (not the model miServer serves: nothing to compare)"
    llama = {"available": importlib.util.find_spec("xllamacpp") is not None, "gguf": str(gguf)}
    if llama["available"]:
        llama["version"] = importlib.metadata.version("xllamacpp")
        labels["llamacpp"] = f"llama.cpp (xllamacpp {llama['version']})"
        servers["llamacpp"] = {}
        for level in args.chats:
            with llama_server(gguf, level, 256 + args.max_tokens, torch.get_num_threads()) as url:
                servers["llamacpp"][level] = measure(url, gguf.name, level, args)

    first = args.chats[0]
    figures = {"chats": args.chats, "max_tokens": args.max_tokens, "rounds": args.rounds, "llamacpp_server": llama,
               **{label: {str(level): value for level, value in by_level.items()} for label, by_level in servers.items()}}
    rows = [("sizes", f"{' and '.join(map(str, args.chats))} concurrent greedy chats of {args.max_tokens} tokens, "
                      f"{args.rounds} each; llama.cpp serves {gguf.name}{elsewhere} with a slot per chat, "
                      f"{torch.get_num_threads()} threads")]
    if not llama["available"]:
        rows.append(("llama.cpp", "xllamacpp is not installed (pip install -e '.[bench]'): not measured"))
    for level in args.chats:
        for label, by_level in servers.items():
            value = by_level[level]
            rows.append((f"{level} chats, {labels[label]}",
                         f"{value['tokens_per_s']:.1f} tokens/s, p50 {value['p50_s'] * 1000:.0f} ms, "
                         f"p99 {value['p99_s'] * 1000:.0f} ms" + describe_answers(value)))
    ours, serial = servers["miserver"][first], servers["serial"][first]
    theirs = servers.get("llamacpp", {}).get(first)
    checks = [
        check(f"tokens/s at {first} chats vs llama.cpp", f"{ours['tokens_per_s']:.1f}",
              f">= llama.cpp's {theirs['tokens_per_s']:.1f}" if theirs else ">= llama.cpp's (xllamacpp not installed)",
              theirs is not None and ours["tokens_per_s"] >= theirs["tokens_per_s"] and ours["errors"] == 0),
        check(f"p50 at {first} chats vs ENGINE_MAX_SEQUENCES=1", f"{ours['p50_s'] * 1000:.0f} ms",
              f"<= half of {serial['p50_s'] * 1000:.0f} ms", ours["p50_s"] <= serial["p50_s"] / 2 and ours["errors"] == 0),
    ]
    return report("concurrency", rows, figures, checks)


def measure(url, model_id, level, args):
    """`level` clients, all started together, each sending args.rounds chats of its own."""
    import httpx

    from bench.common import CHAT, chat_body, percentile

    prompts = [f"Write a few sentences about {SUBJECTS[index % len(SUBJECTS)]}, story number {index}."
               for index in range(level * args.rounds)]
    deadline = time.monotonic() + args.time_limit

    def at_once(client, bodies):
        """Each client's bodies one after another, every client started together: (answers, wall s)."""
        start = threading.Barrier(len(bodies) + 1)

        def one_client(own):
            start.wait()
            answers = []
            for body in own:
                if time.monotonic() > deadline:
                    break
                started = time.perf_counter()
                try:
                    answer = client.post(CHAT, json=body)
                except httpx.HTTPError as error:
                    answer = error
                answers.append((time.perf_counter() - started, answer))
            return answers

        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(one_client, own) for own in bodies]
            start.wait()
            started = time.perf_counter()
            answers = [answer for future in futures for answer in future.result()]
            return answers, time.perf_counter() - started

    limits = httpx.Limits(max_connections=level + 1, max_keepalive_connections=level + 1)
    with httpx.Client(base_url=url, timeout=args.time_limit, limits=limits) as client:
        # Warm: every slot or seat once, at the same concurrency, with short answers.
        at_once(client, [[chat_body(model_id, f"Say hello to number {c}.", 4)] for c in range(level)])
        answers, wall = at_once(client, [[chat_body(model_id, prompts[c * args.rounds + r], args.max_tokens)
                                          for r in range(args.rounds)] for c in range(level)])
    done = [(seconds, answer) for seconds, answer in answers if getattr(answer, "status_code", None) == 200]
    failures = collections.Counter(str(getattr(answer, "status_code", type(answer).__name__))
                                   for _, answer in answers if getattr(answer, "status_code", None) != 200)
    if len(answers) < level * args.rounds:
        failures["not sent in --time-limit"] = level * args.rounds - len(answers)
    latencies = [seconds for seconds, _ in done] or [float("nan")]
    tokens = sum(answer.json()["usage"]["completion_tokens"] for _, answer in done)
    return {
        "chats": level * args.rounds, "answered": len(done), "errors": level * args.rounds - len(done),
        "failures": dict(failures), "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
        "p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
        "backends": dict(collections.Counter(answer.headers.get("x-millm-backend", "none") for _, answer in done)),
        "latencies_s": [round(seconds, 3) for seconds in latencies],
    }


def describe_answers(value):
    """What else a reader needs: errors, and which backend miServer says answered."""
    parts = []
    if value["errors"]:
        parts.append(f"{value['errors']} of {value['chats']} failed {value['failures']}")
    if set(value["backends"]) != {"none"}:
        parts.append("X-miLLM-Backend " + ", ".join(f"{name} {count}" for name, count in sorted(value["backends"].items())))
    return f" ({'; '.join(parts)})" if parts else ""


@contextlib.contextmanager
def llama_server(gguf, slots, context, threads, timeout=120, embedding=False, chat_template=None):
    """llama.cpp's server (xllamacpp.Server) on 127.0.0.1, in a process of its own: `slots`
    parallel sequences of `context` tokens each, `threads` threads (`embedding`: serving
    /v1/embeddings too; `chat_template`: a built-in template's name, for a GGUF that has none).
    Yields its base URL."""
    from tests.e2e.stack import answers, free_port

    log = tempfile.TemporaryFile()
    process = subprocess.Popen([sys.executable, "-c", SERVE, str(gguf), str(free_port()), str(slots), str(context), str(threads),
                                "embedding" if embedding else "-", chat_template or ""],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)

    def failed(why):
        log.seek(0)
        return RuntimeError(f"llama.cpp's server {why}:\n{log.read().decode(errors='replace')[-4000:]}")

    try:
        url = process.stdout.readline().strip()  # its address, once the model is loaded ("" if it died)
        if not url:
            raise failed("exited before it listened")
        deadline = time.monotonic() + timeout
        while not answers(url + "/health"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise failed("did not answer /health")
            time.sleep(0.1)
        try:
            yield url
        except Exception as error:  # a dropped request: say whether the server died, and its last words
            if process.poll() is not None:
                raise failed(f"exited (status {process.returncode}) while serving") from error
            raise failed(f"was serving when a request failed ({type(error).__name__}: {error})") from error
    finally:
        process.stdin.close()  # its stdin.read() returns, and the process ends
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


if __name__ == "__main__":
    main()
