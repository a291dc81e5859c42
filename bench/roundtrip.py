"""roundtrip: a small embeddings request over HTTP, through web and the Channels layer to the
engine and back, versus the same service call inside the engine's process.
Goal: under 5 ms added at p50.

    python -m bench.roundtrip [--requests 300] [--model PATH]

Both sides run the tiny test model (default), so the figure is the route's cost, not the model's.
They alternate in blocks of 25, so drift on a shared machine falls on both.
"""

import argparse

GOAL_MS = 5.0


def main(argv=None, running=None):
    """`running`: a stack of the same model to use instead of starting one."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny test model)")
    args = parser.parse_args(argv)

    from bench.common import check, load_resident, percentile, report, setup_django, stack_for, tiny_model

    setup_django()
    import time

    import httpx
    import torch

    from inference_app.engine import services
    from inference_app.schemas import parse_request

    model = args.model or str(tiny_model())
    resident = load_resident(model)
    body = {"model": resident.model_id, "input": "a small request to embed"}
    parsed = parse_request("/v1/embeddings", body, True)
    over_http, in_engine = [], []
    with stack_for(model, running) as running, httpx.Client(base_url=running.web.url, timeout=60) as client:
        for _ in range(10):  # warm both sides
            client.post("/v1/embeddings", json=body).raise_for_status()
            services.run(resident, parsed)
        while len(over_http) < args.requests:
            for _ in range(25):
                started = time.perf_counter()
                client.post("/v1/embeddings", json=body).raise_for_status()
                over_http.append(time.perf_counter() - started)
            with torch.inference_mode():
                for _ in range(25):
                    started = time.perf_counter()
                    services.run(resident, parsed)
                    in_engine.append(time.perf_counter() - started)
    http_p50, engine_p50 = percentile(over_http, 0.5) * 1000, percentile(in_engine, 0.5) * 1000
    added = http_p50 - engine_p50
    figures = {
        "model": resident.model_id, "requests": len(over_http),
        "http_p50_ms": http_p50, "http_p99_ms": percentile(over_http, 0.99) * 1000,
        "service_p50_ms": engine_p50, "added_p50_ms": added,
    }
    return report("roundtrip", [
        ("model", f"{resident.model_id}, {len(over_http)} embeddings requests of one short input"),
        ("over HTTP p50 / p99", f"{http_p50:.2f} / {figures['http_p99_ms']:.2f} ms"),
        ("the service call in-process p50", f"{engine_p50:.2f} ms"),
    ], figures, [check("added by web and the Channels layer (p50)", f"{added:.2f} ms", f"< {GOAL_MS:g} ms", added < GOAL_MS)])


if __name__ == "__main__":
    main()
