"""memory: peak resident memory of web during a 200 MB upload (uvicorn, and daphne beside it for
the record), and of the engine while it validates, runs and assembles a 50,000-line batch, each
versus the same process idle just before. Goal: under 100 MB growth each under uvicorn.

    python -m bench.memory [--upload-mb 200] [--lines 50000] [--model PATH]

Peaks are the kernel's VmHWM, reset (clear_refs) just before each operation.
"""

import argparse

GOAL_MB = 100


def write_upload(path, megabytes, line_bytes=4_194):
    """A batch file of `megabytes` MB in lines of about 4 KB (the shape of a big real upload)."""
    lines = max(1, megabytes * 1_000_000 // line_bytes)
    pad = "x" * (line_bytes - 1 - len('{"custom_id": "r000000", "pad": ""}'))
    with open(path, "w") as handle:
        for index in range(lines):
            handle.write(f'{{"custom_id": "r{index:06d}", "pad": "{pad}"}}\n')
    return path.stat().st_size


def main(argv=None, running=None):
    """`running`: a stack of the same model to use instead of starting one."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upload-mb", type=int, default=200)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny test model)")
    args = parser.parse_args(argv)

    from bench.common import (
        check, report, reset_peak, rss_mb, scoring_lines, setup_django, stack_for, start_batch, tiny_model, wait_batch,
    )

    setup_django()
    import tempfile
    from pathlib import Path

    import httpx

    from tests.e2e.stack import PYTHON, Process, answers, free_port, wait_until

    def upload_growth(url, pid, path):
        with httpx.Client(base_url=url, timeout=600) as client:
            client.get("/v1/files?limit=1").raise_for_status()  # warm: imports and the first query
            idle = rss_mb(pid)
            reset_peak(pid)
            with open(path, "rb") as handle:
                answer = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("big.jsonl", handle)})
            answer.raise_for_status()
            return idle, rss_mb(pid, "VmHWM") - idle

    model = args.model or str(tiny_model())
    with tempfile.TemporaryDirectory() as folder, stack_for(model, running) as running:
        size = write_upload(Path(folder) / "big.jsonl", args.upload_mb)
        uvicorn_idle, uvicorn_growth = upload_growth(running.web.url, running.web.popen.pid, Path(folder) / "big.jsonl")
        port = free_port()
        daphne = Process("daphne", [PYTHON, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                                    "millm_site.asgi:application"], running.env, running.work_dir)
        running.processes.append(daphne)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers(url + "/api/health"), 60, "daphne did not start", daphne)
        daphne_idle, daphne_growth = upload_growth(url, daphne.popen.pid, Path(folder) / "big.jsonl")
        daphne.stop()

        engine = running.engine.popen.pid
        with httpx.Client(base_url=running.web.url, timeout=600) as client:
            lines = scoring_lines(running.model_id, [f"Item {i}: keep it?" for i in range(args.lines)], logprobs=1)
            wait_batch(client, start_batch(client, lines[:16])["id"])  # warm
            engine_idle = rss_mb(engine)
            reset_peak(engine)
            # Packed (16 rows a forward pass): the rows' run is not what this part measures.
            batch = wait_batch(client, start_batch(client, lines, pack=True)["id"], poll_s=0.5)
            engine_growth = rss_mb(engine, "VmHWM") - engine_idle
        assert batch["status"] == "completed", batch
    figures = {
        "upload_bytes": size, "batch_lines": args.lines,
        "uvicorn_idle_mb": uvicorn_idle, "uvicorn_growth_mb": uvicorn_growth,
        "daphne_idle_mb": daphne_idle, "daphne_growth_mb": daphne_growth,
        "engine_idle_mb": engine_idle, "engine_growth_mb": engine_growth,
    }
    return report("memory", [
        ("sizes", f"a {size / 1e6:.0f} MB upload; a {args.lines:,}-line scoring batch on the tiny model"),
        ("web, uvicorn", f"{uvicorn_idle:.0f} MB idle, +{uvicorn_growth:.1f} MB at peak during the upload"),
        ("web, daphne (for the record)", f"{daphne_idle:.0f} MB idle, +{daphne_growth:.1f} MB at peak during the upload"),
        ("engine", f"{engine_idle:.0f} MB idle, +{engine_growth:.1f} MB at peak validating, running and assembling"),
    ], figures, [
        check("web (uvicorn) growth during the upload", f"{uvicorn_growth:.1f} MB", f"< {GOAL_MB} MB", uvicorn_growth < GOAL_MB),
        check("engine growth during the batch", f"{engine_growth:.1f} MB", f"< {GOAL_MB} MB", engine_growth < GOAL_MB),
    ])


if __name__ == "__main__":
    main()
