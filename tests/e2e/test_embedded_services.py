"""A machine without PostgreSQL and Redis: `make run` and `make test` start their own from the
wheels (scripts/services.py). Here on free ports, never the default ones, which the machine's own
servers may hold while the tests run."""

import importlib.util
import os
import shutil
import socket
import tempfile
from pathlib import Path

from tests.e2e.batch_helpers import line, read_jsonl, start_batch, wait_for
from tests.e2e.conftest import MODEL_ID, make_client
from tests.e2e.stack import ROOT, Stack, free_port

_spec = importlib.util.spec_from_file_location("services", ROOT / "scripts" / "services.py")
services = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(services)

CHAT = "/v1/chat/completions"


def processes_working_in(folder):
    """Pids of live processes whose working folder is inside `folder`: the postmaster and its
    children work in their data folder, redis-server in its --dir."""
    folder = str(Path(folder).resolve())
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cwd = os.readlink(entry / "cwd") if entry.name.isdigit() else ""
        except OSError:  # gone, or a zombie: nothing left of it
            continue
        if cwd == folder or cwd.startswith(folder + os.sep):
            pids.append(int(entry.name))
    return pids


def test_a_batch_runs_end_to_end_on_the_embedded_servers(tmp_path, test_model_dir):
    # Not under tmp_path: each pytest run (another one on this machine, too) sets pytest's own
    # temporary root back to 0700, which shuts the `postgres` user out of the data folder.
    data = Path(tempfile.mkdtemp(prefix="millm-embedded-"))
    env = {"MILLM_DATA_DIR": str(data)}  # no DATABASE_URL, no REDIS_URL
    postgres_port, redis_port = free_port(), free_port()
    started = services.start_missing(env, postgres_port=postgres_port, redis_port=redis_port)
    try:
        assert started == ["postgres", "redis"]
        assert (data / "postgres" / "PG_VERSION").read_text().strip() == "18"
        assert len(processes_working_in(data)) >= 2
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        with Stack.running(tmp_path / "stack", test_model_dir, pg_port=postgres_port, redis_url=redis_url) as stack:
            client = make_client(stack.web.url)
            requests = [{"model": MODEL_ID, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 4,
                         "temperature": 0} for i in range(3)]
            batch = start_batch(client, [line(f"row-{i}", CHAT, body) for i, body in enumerate(requests)], CHAT)
            batch = wait_for(client, batch.id, timeout=60)
            assert batch.status == "completed", batch
            assert batch.request_counts.completed == 3 and batch.request_counts.failed == 0
            output = read_jsonl(client, batch.output_file_id)
            assert [row["custom_id"] for row in output] == ["row-0", "row-1", "row-2"]
            assert all(row["response"]["status_code"] == 200 for row in output)
            assert all(row["response"]["body"]["choices"][0]["message"]["role"] == "assistant" for row in output)
            # Both servers were really the wheels': PostgreSQL 18, and Redis served the stack.
            [(version,)] = stack.sql("SHOW server_version_num")
            assert version.startswith("18")
    finally:
        services.stop(started, env)
        left = processes_working_in(data)
        shutil.rmtree(data, ignore_errors=True)
    assert left == []


def test_an_explicit_url_wins_and_starts_nothing(tmp_path):
    nowhere = free_port()
    env = {"MILLM_DATA_DIR": str(tmp_path / "var"), "DATABASE_URL": f"postgres://postgres@127.0.0.1:{nowhere}/x",
           "REDIS_URL": f"redis://127.0.0.1:{nowhere}/0"}
    assert services.start_missing(env, postgres_port=free_port(), redis_port=free_port()) == []
    assert not (tmp_path / "var").exists()


def test_a_server_that_already_answers_is_used_as_it_is(tmp_path):
    with socket.socket() as first, socket.socket() as second:
        for listener in (first, second):
            listener.bind(("127.0.0.1", 0))
            listener.listen()
        env = {"MILLM_DATA_DIR": str(tmp_path / "var")}
        ports = {"postgres_port": first.getsockname()[1], "redis_port": second.getsockname()[1]}
        assert services.start_missing(env, **ports) == []
    assert not (tmp_path / "var").exists()
