"""retention: the database bytes a completed embeddings batch leaves behind, against the bytes
of its output file (what its rows kept before issue 16: every vector). Goal: a 10,000-row batch
leaves under 2 MB (200 bytes a row).

    python -m bench.retention [--rows 10000] [--model PATH]

Real web and engine processes; the bytes are PostgreSQL's own count (pg_column_size) of the
batch's rows and of the batch itself, read after the batch completed.
"""

import argparse
import json

GOAL_BYTES_PER_ROW = 200  # 2 MB for 10,000 rows


def main(argv=None, running=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the packaged SmolLM2)")
    args = parser.parse_args(argv)

    from bench.common import check, report, run_batch, setup_django, stack_for

    setup_django()
    import httpx

    from millm_lib.limits import EMBEDDINGS

    with stack_for(args.model, running) as running, httpx.Client(base_url=running.web.url, timeout=600) as client:
        model_id = client.get("/v1/models").json()["data"][0]["id"]
        lines = [json.dumps({"custom_id": f"row-{n}", "method": "POST", "url": EMBEDDINGS,
                             "body": {"model": model_id, "input": f"a short text to embed, number {n}"}})
                 for n in range(args.rows)]
        batch, output = run_batch(client, lines, EMBEDDINGS)
        rows_bytes, batch_bytes = running.sql(
            "SELECT (SELECT coalesce(sum(pg_column_size(r.*)), 0) FROM batches_app_batchrow r WHERE r.batch_id = %s), "
            "(SELECT pg_column_size(b.*) FROM batches_app_batch b WHERE b.id = %s)", [batch["id"], batch["id"]]
        )[0]
    left = rows_bytes + batch_bytes
    per_row = left / args.rows
    figures = {"model": model_id, "rows": args.rows, "rows_bytes": rows_bytes, "batch_bytes": batch_bytes,
               "bytes_per_row": per_row, "output_file_bytes": len(output),
               "bytes_for_10000_rows": per_row * 10_000}
    return report("retention", [
        ("model", f"{model_id}, {args.rows} embeddings rows, completed"),
        ("left in PostgreSQL (rows + batch)", f"{left:,} bytes ({per_row:.0f} a row)"),
        ("its output file (what the rows kept before)", f"{len(output):,} bytes ({len(output) / args.rows:.0f} a row)"),
    ], figures, [check("database bytes a 10,000-row embeddings batch leaves", f"{per_row * 10_000 / 1e6:.2f} MB",
                       "< 2 MB", per_row < GOAL_BYTES_PER_ROW)])


if __name__ == "__main__":
    main()
