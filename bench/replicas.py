"""replicas: one batch run on 1 replica and on 2 replicas of the model (ENGINE_MAX_REPLICAS,
issue 19), on one stack with ENGINE_MAX_REPLICAS=2: first with one engine (a replica with no
peer runs exactly as with ENGINE_MAX_REPLICAS=1), then with a second one started. The replica that claims
the batch leads it and runs rows; the other helps by claiming chunks of the same batch's rows.
Goal: 2 replicas at least 1.5x the rows per second of one (2x is the ideal).

    python -m bench.replicas [--rows 240] [--max-tokens 16] [--scoring-rows 1200] [--repeats 3] [--model PATH]

The headline is generation rows (/v1/completions, greedy, `max_tokens` tokens each, a row per
chunk: the model's decoding dominates); scoring rows (max_tokens 1, logprobs 5, BATCH_CHUNK_ROWS
a chunk) are measured beside them, where the per-chunk bookkeeping and PostgreSQL write weigh
more. Rows per second = the batch's rows / (completed_at - in_progress_at, the batch's own
timestamps): every row run, and the leader's assembly; not the upload or validation. Each phase
runs --repeats batches of each kind, the kinds alternating, and the median batch counts. Rows and
chunks per replica come from the rows' `ran_by` in the stack's database (SELECT ran_by, count(*)
... GROUP BY ran_by), labelled by the replica's seat. Beside them: the CPU seconds the engines,
web and the database's PostgreSQL backends used from the batch's create to its completion (from
/proc), and the p50 of one transaction that locks the batch's row, updates it and commits: every
chunk's record of one batch holds that lock in turn, which bounds one batch's chunks per second
whatever the number of replicas.

Every engine runs with ENGINE_MAX_SEQUENCES=1 (serial decoding: a replica runs one row at a
time, so the ratio measures replicas, not batched decoding) and one torch thread: the project
has no torch-threads setting, so the stacks' processes get OMP_NUM_THREADS=1 and
MKL_NUM_THREADS=1, which torch reads at start-up. BATCH_WAIT_POLL_S is 0.5 s (default 5,
--wait-poll-s); the replica that validates a batch wakes the others, so a helper joins at once
whatever the poll; the part reports when each replica recorded its first row. The model is the tiny test model unless
--model names another.
"""

import argparse
import contextlib
import os
import signal
import subprocess

GOAL = 1.5
THREADS = {"OMP_NUM_THREADS": 1, "MKL_NUM_THREADS": 1}
SUBJECTS = ["a lighthouse", "the river", "a small robot", "winter", "the market", "a violin", "the moon",
            "an old map", "bread", "the train", "a garden", "the storm", "a clock", "the desert", "a letter",
            "the forest"]


def main(argv=None):
    """Starts its own stack (ENGINE_MAX_REPLICAS=2) with one engine, measures, then starts the
    second replica and measures again."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=240, help="generation rows in the batch")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each generation row decodes")
    parser.add_argument("--scoring-rows", type=int, default=1200, help="scoring rows in the second batch (0: none)")
    parser.add_argument("--repeats", type=int, default=3, help="batches of each kind with 1 and with 2 replicas (the median counts)")
    parser.add_argument("--wait-poll-s", type=float, default=0.5, help="BATCH_WAIT_POLL_S of the stacks")
    parser.add_argument("--model", default=None, help="a model folder (default: the tiny test model)")
    args = parser.parse_args(argv)

    from bench.common import COMPLETIONS, check, report, scoring_lines, setup_django, tiny_model

    setup_django()
    import json

    import httpx

    model = args.model or str(tiny_model())
    settings = {**THREADS, "ENGINE_MAX_SEQUENCES": 1, "BATCH_WAIT_POLL_S": args.wait_poll_s}
    measured = {}  # replicas -> {"generation": the median run's figures, "scoring": ...}
    with replicas_stack(model, **settings) as running:
        for replicas in (1, 2):
            if replicas == 2:
                running.replicas.append(running.start_engine())
                wait_for_replicas(running, 2)
            model_id = running.model_id
            generation = [json.dumps({"custom_id": f"row-{index}", "method": "POST", "url": COMPLETIONS,
                                      "body": {"model": model_id, "prompt": prompt(index), "max_tokens": args.max_tokens,
                                               "temperature": 0}})
                          for index in range(args.rows)]
            scoring = scoring_lines(model_id, [prompt(index) for index in range(args.scoring_rows)])
            with httpx.Client(base_url=running.web.url, timeout=600) as client:
                # Warm: each replica's first queries and forward passes, both kinds of row in one
                # small batch (the lines' custom_ids differ: row-0.. and row-2r..).
                timed(running, client, generation[:2 * replicas] + scoring[2 * replicas:10 * replicas])
                runs = {"generation": [], "scoring": []}
                for _ in range(args.repeats):  # the two kinds alternate, so drift falls on both
                    runs["generation"].append(timed(running, client, generation))
                    if args.scoring_rows:
                        runs["scoring"].append(timed(running, client, scoring))
                measured[replicas] = {kind: median_run(values) for kind, values in runs.items() if values}
        commit_ms = locked_commit_ms(running, measured[2]["generation"]["batch"])
        stop_engines(running)

    one, two = measured[1]["generation"], measured[2]["generation"]
    ratio = two["rows_per_s"] / one["rows_per_s"]
    figures = {
        "model": model_id, "rows": args.rows, "max_tokens": args.max_tokens, "scoring_rows": args.scoring_rows,
        "repeats": args.repeats, "wait_poll_s": args.wait_poll_s, "timed_from": "in_progress_at to completed_at",
        "one_replica_rows_per_s": one["rows_per_s"], "two_replicas_rows_per_s": two["rows_per_s"], "ratio": ratio,
        "rows_per_engine": two["rows_per_engine"],
        "postgres_cpu_ms_per_chunk": two["postgres_cpu_ms_per_chunk"], "batch_row_commit_ms": commit_ms,
        "runs": {f"{replicas}_replicas": value for replicas, value in measured.items()},
    }
    rows = [("sizes", f"{model_id}, {args.rows} greedy /v1/completions rows of max_tokens {args.max_tokens}"
                      + (f", and {args.scoring_rows} scoring rows" if args.scoring_rows else "")
                      + f"; {args.repeats} batch(es) of each with 1, then 2 replicas, the median shown; ENGINE_MAX_SEQUENCES=1, "
                        "one torch thread an engine; rows/s over in_progress_at to completed_at")]
    for replicas in (1, 2):
        rows.append((f"generation, {replicas} replica{'s' if replicas > 1 else ''}", describe(measured[replicas]["generation"])))
    if args.scoring_rows:
        s_one, s_two = measured[1]["scoring"], measured[2]["scoring"]
        figures.update({"scoring_one_replica_rows_per_s": s_one["rows_per_s"],
                        "scoring_two_replicas_rows_per_s": s_two["rows_per_s"],
                        "scoring_ratio": s_two["rows_per_s"] / s_one["rows_per_s"]})
        for replicas in (1, 2):
            rows.append((f"scoring, {replicas} replica{'s' if replicas > 1 else ''}", describe(measured[replicas]["scoring"])))
        rows.append(("scoring, 2 replicas / 1", f"{figures['scoring_ratio']:.2f}x"))
    rows.append(("one batch's fence", f"locking and updating the batch row, committed: {commit_ms:.2f} ms at p50 "
                                      f"(every chunk's record of one batch holds that lock in turn: at most "
                                      f"{1000 / commit_ms:.0f} chunks/s for one batch, however many replicas)"))
    per_engine = list(two["rows_per_engine"].values())
    return report("replicas", rows, figures, [
        check("2 replicas / 1, generation rows per second", f"{ratio:.2f}x", f">= {GOAL}x", ratio >= GOAL),
        check("generation rows each replica ran (2 replicas)", " / ".join(map(str, per_engine)),
              f"both > 0, {args.rows} in all",
              len(per_engine) == 2 and min(per_engine) > 0 and sum(per_engine) == args.rows),
    ])


def median_run(runs):
    """The run with the median rows per second (the lower middle one of an even count), with every
    run's rows per second and first rows beside its own figures."""
    ordered = sorted(runs, key=lambda run: run["rows_per_s"])
    return {**ordered[(len(ordered) - 1) // 2], "every_rows_per_s": [round(run["rows_per_s"], 2) for run in runs],
            "every_first_row_after_s": [run["first_row_after_s"] for run in runs]}


def prompt(index):
    return f"Write a few sentences about {SUBJECTS[index % len(SUBJECTS)]}, story number {index}."


@contextlib.contextmanager
def replicas_stack(model, **settings):
    """bench.common.stack with ENGINE_MAX_REPLICAS=2 and its one engine (a replica with no peer
    runs exactly as with ENGINE_MAX_REPLICAS=1); `running.replicas` lists the engines started."""
    from bench.common import stack

    with stack(model, ENGINE_MAX_REPLICAS=2, **settings) as running:
        running.replicas = [running.engine]
        yield running


def wait_for_replicas(running, count, timeout=120):
    """Until `count` engines are live and active with the model resident (an engine that exits
    fails the wait at once, with its log)."""
    from tests.e2e.stack import wait_until

    def ready():
        for process in running.replicas:
            if not process.alive:
                raise AssertionError(f"an engine exited before it was active:\n{process.log()[-4000:]}")
        engines = running.engines(running.web)
        return sum(1 for e in engines if e["alive"] and e["role"] == "active" and e["resident_model"] == running.model_id) == count

    wait_until(ready, timeout, f"{count} replicas of {running.model_id} did not become active")


def stop_engines(running, timeout=30):
    """SIGTERM every engine at once and wait for them (the stack would stop them one by one)."""
    engines = [process for process in running.replicas if process.alive]
    for process in engines:
        process.popen.send_signal(signal.SIGTERM)
    for process in engines:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.popen.wait(timeout)  # one still running is stopped by the stack's close


def timed(running, client, lines, poll_s=0.25):
    """Run `lines` as one /v1/completions batch; its figures from its own timestamps and rows."""
    from bench.common import output_rows, start_batch, wait_batch

    before = cpu_seconds(running)
    batch = wait_batch(client, start_batch(client, lines)["id"], poll_s)
    cpu = {group: round(value, 2) for group, value in cpu_used(before, cpu_seconds(running)).items()}
    if batch["status"] != "completed" or batch["request_counts"]["completed"] != len(lines):
        raise RuntimeError(f"batch {batch['id']} ended {batch['status']} with {batch['request_counts']}: {batch.get('errors')}")
    started, finalizing, completed = running.sql(
        "SELECT in_progress_at, finalizing_at, completed_at FROM batches_app_batch WHERE id = %s", [batch["id"]])[0]
    seconds = (completed - started).total_seconds()
    engines = running.sql(
        "SELECT r.ran_by, e.seat, count(*), count(DISTINCT r.chunk), min(r.recorded_at) FROM batches_app_batchrow r "
        "LEFT JOIN inference_app_engine e ON e.id = r.ran_by WHERE r.batch_id = %s GROUP BY r.ran_by, e.seat "
        "ORDER BY e.seat", [batch["id"]])
    names = {engine: f"seat {seat}" for engine, seat, *_ in engines}
    chunks = sum(chunks for _, _, _, chunks, _ in engines)
    tokens = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in output_rows(client, batch).values())
    return {
        "batch": batch["id"], "rows": len(lines), "seconds": seconds, "rows_per_s": len(lines) / seconds,
        "run_s": (finalizing - started).total_seconds(), "assemble_s": (completed - finalizing).total_seconds(),
        "rows_per_engine": {names[engine]: rows for engine, _, rows, _, _ in engines},
        "chunks_per_engine": {names[engine]: chunks for engine, _, _, chunks, _ in engines},
        "chunks": chunks, "chunks_per_s": chunks / seconds,
        "first_row_after_s": {names[engine]: round((first - started).total_seconds(), 2) for engine, _, _, _, first in engines},
        "completion_tokens": tokens,
        "engine_ids": {name: engine for engine, name in names.items()},
        "cpu_s": cpu, "postgres_cpu_ms_per_chunk": 1000 * cpu["postgres"] / chunks,
    }


def locked_commit_ms(running, batch_id, count=100):
    """The p50 ms of a transaction that locks a batch's row (SELECT ... FOR UPDATE), updates it
    and commits (a WAL flush): the part of each chunk's record that no other chunk of the same
    batch can overlap (Batch.record_chunk locks the row, then writes the rows and the counts)."""
    import statistics
    import time

    import psycopg

    timings = []
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:{running.pg_port}/{running.db_name}", autocommit=True) as conn:
        for _ in range(count):
            started = time.perf_counter()
            with conn.transaction():
                conn.execute("SELECT id FROM batches_app_batch WHERE id = %s FOR UPDATE", [batch_id])
                conn.execute("UPDATE batches_app_batch SET completed = completed WHERE id = %s", [batch_id])
            timings.append(time.perf_counter() - started)
    return statistics.median(timings) * 1000


def cpu_seconds(running):
    """(group, pid) -> CPU seconds (user + system) so far, for the stack's engines, its web
    process and the PostgreSQL backends of its database."""
    tick = os.sysconf("SC_CLK_TCK")
    backends = running.sql("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
    groups = {"engines": [process.popen.pid for process in running.replicas], "web": [running.web.popen.pid],
              "postgres": [pid for (pid,) in backends]}
    seconds = {}
    for group, pids in groups.items():
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()  # after the command's name
            except OSError:
                continue  # it ended
            seconds[(group, pid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return seconds


def cpu_used(before, after):
    """CPU seconds each group used between two cpu_seconds(): a backend that started between
    them counts from its start; one that ended between them is not counted."""
    used = {"engines": 0.0, "web": 0.0, "postgres": 0.0}
    for (group, pid), value in after.items():
        used[group] += value - before.get((group, pid), 0.0)
    return used


def describe(value):
    per_engine = ", ".join(f"{name} {rows} rows in {value['chunks_per_engine'][name]} chunks, first after "
                           f"{value['first_row_after_s'][name]} s" for name, rows in value["rows_per_engine"].items())
    cpu = value["cpu_s"]
    every = value["every_rows_per_s"]
    spread = f" (median of {', '.join(map(str, every))})" if len(every) > 1 else ""
    return (f"{value['rows_per_s']:.2f} rows/s{spread} ({value['seconds']:.1f} s, {value['chunks_per_s']:.1f} chunks/s, "
            f"{value['completion_tokens']} completion tokens); {per_engine}; CPU from create to completed: engines "
            f"{cpu['engines']:.1f} s, web {cpu['web']:.1f} s, PostgreSQL {cpu['postgres']:.1f} s "
            f"({value['postgres_cpu_ms_per_chunk']:.1f} ms a chunk)")


if __name__ == "__main__":
    main()
