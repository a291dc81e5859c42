"""Real processes for end-to-end tests: uvicorn (web) and runbatchworker (engine) against
PostgreSQL and Redis, in a database of their own so that nothing else disturbs them."""

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


# An engine silent this long looks dead to the others (its claims are released).
ENGINE_STALE_S = 3

def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    def __init__(self, name, args, env, log_dir):
        self.name = name
        self.log_path = Path(log_dir) / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def alive(self):
        return self.popen.poll() is None

    def log(self):
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout=30):
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
        return self.popen.returncode

    def kill(self):
        if self.alive:
            self.popen.kill()
            self.popen.wait()
        self._log.close()


_TEMPLATE = []  # the name of this process's migrated template database, once made
_TEMPLATE_LOCK = threading.Lock()


def _drop_template():
    with contextlib.suppress(psycopg.Error), psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(_TEMPLATE[0])))


class Stack:
    """One database and channel prefix; any number of web and engine processes on them."""

    def __init__(self, work_dir, model_dir, pg_port=5432, redis_url="redis://127.0.0.1:6379/0", **settings):
        """`pg_port` and `redis_url`: another PostgreSQL cluster and Redis (tests/e2e/faults.py
        starts private ones, so that restarting them disturbs nothing else)."""
        self.work_dir = Path(work_dir)
        self.model_dir = Path(model_dir)
        self.tag = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.db_name = f"millm_e2e_{self.tag}"
        self.pg_port = pg_port
        self.admin_dsn = ADMIN_DSN if pg_port == 5432 else f"postgresql://postgres@127.0.0.1:{pg_port}/postgres"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "millm_site.settings",
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:{pg_port}/{self.db_name}",
            "REDIS_URL": redis_url,
            "MILLM_CHANNEL_PREFIX": f"millm-e2e-{self.tag}",
            "MILLM_MODEL": str(self.model_dir),
            "MILLM_DATA_DIR": str(self.work_dir / "data"),
            "ENGINE_HEARTBEAT_S": "0.5",
            "ENGINE_STALE_S": str(ENGINE_STALE_S),
            "PYTHONUNBUFFERED": "1",
            "MILLM_LOG_EXECUTIONS": "true",  # `executions()` counts the rows each engine ran
            **{key: str(value) for key, value in settings.items()},
        }
        self.env.pop("MILLM_API_KEYS", None)
        self.processes = []

    def create_database(self):
        """The stack's database, migrated. On the shared cluster it is a copy of a template this
        process migrated once (CREATE DATABASE ... TEMPLATE: 0.3 s, where `migrate` takes 4.5 s
        a stack); the migrations write no rows on an empty database, so the copy is what
        `migrate` would make. A private cluster (tests/e2e/faults.py) migrates its own."""
        if self.pg_port != 5432:
            self._create_and_migrate(self.db_name)
            return
        with _TEMPLATE_LOCK:
            if not _TEMPLATE:
                _TEMPLATE.append(f"millm_e2e_template_{os.getpid()}")
                self._create_and_migrate(_TEMPLATE[0])
                atexit.register(_drop_template)
            with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(self.db_name), sql.Identifier(_TEMPLATE[0])))

    def _create_and_migrate(self, name):
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        env = {**self.env, "DATABASE_URL": f"postgres://postgres@127.0.0.1:{self.pg_port}/{name}"}
        subprocess.run([PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True)

    @classmethod
    @contextlib.contextmanager
    def running(cls, work_dir, model_dir, **settings):
        """A database, one engine and one web process, up with the model resident; all gone after."""
        stack = cls(work_dir, model_dir, **settings)
        stack.create_database()
        try:
            stack.engine = stack.start_engine()
            stack.web = stack.start_web()
            # A compiled decode step compiles at load: minutes on a CPU (README, Precision).
            timeout = 900 if settings.get("MILLM_COMPILE") == "decode" else 120
            stack.wait_for_model(stack.web, stack.model_id, timeout=timeout, engine=stack.engine)
            yield stack
        finally:
            stack.close()

    def sql(self, query, params=()):
        """Read the stack's database directly, as an operator would."""
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{self.pg_port}/{self.db_name}") as conn:
            return conn.execute(query, params).fetchall()

    @property
    def model_id(self):
        """The id the engine serves its model under: MILLM_MODEL_ID, or the folder's name."""
        return self.env.get("MILLM_MODEL_ID") or self.model_dir.name

    @property
    def data_dir(self):
        return Path(self.env["MILLM_DATA_DIR"])

    def stored_files(self):
        folder = self.data_dir / "files"
        return sorted(path.name for path in folder.iterdir()) if folder.exists() else []

    def drop_database(self):
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.db_name)))

    def start_engine(self, **settings):
        env = {**self.env, **{key: str(value) for key, value in settings.items()}}
        process = Process("engine", [PYTHON, "manage.py", "runbatchworker"], env, self.work_dir)
        self.processes.append(process)
        return process

    def start_web(self, **settings):
        env = {**self.env, **{key: str(value) for key, value in settings.items()}}
        port = free_port()
        args = [
            PYTHON, "-m", "uvicorn", "millm_site.asgi:application",
            "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--lifespan", "off",
        ]
        process = Process("web", args, env, self.work_dir)
        process.url = f"http://127.0.0.1:{port}"
        self.processes.append(process)
        wait_until(lambda: answers(process.url + "/api/health"), 60, f"web did not start:\n{process.log()}", process)
        return process

    def wait_for_model(self, web, model_id, timeout=120, engine=None):
        def ready():
            detailed = httpx.get(web.url + "/api/health/detailed", timeout=5).json()
            return any(e["alive"] and e["role"] == "active" and e["resident_model"] == model_id for e in detailed["engines"])

        wait_until(ready, timeout, f"no active engine for {model_id}", engine)

    def engine_id(self, model_id=None):
        """The id of the live active engine of the stack's model."""
        model_id = model_id or self.model_id
        return next(e["id"] for e in self.engines(self.web) if e["role"] == "active" and e["model"] == model_id and e["alive"])

    def engines(self, web):
        return httpx.get(web.url + "/api/health/detailed", timeout=5).json()["engines"]

    def executions(self, batch_id):
        """{line: [(the engine process that executed it, when), once per execution]}, read from
        every engine's log, the killed ones' included (`executed batch=... engine=... lines=...
        at=<epoch s>`, a line per chunk, written when the chunk ran and before its record)."""
        runs = {}
        for process in self.processes:
            if process.name != "engine":
                continue
            for found in EXECUTED.finditer(process.log()):
                if found["batch"] == batch_id:
                    for line in found["lines"].split(","):
                        runs.setdefault(int(line), []).append((process, float(found["at"])))
        return runs

    def close(self):
        for process in reversed(self.processes):
            process.stop()
        self.drop_database()


# The engine's audit line of a chunk executed (batches_app/runner.py, MILLM_LOG_EXECUTIONS).
EXECUTED = re.compile(r"executed batch=(?P<batch>\S+) engine=(?P<engine>\S+) lines=(?P<lines>[\d,]+) at=(?P<at>[\d.]+)")


def answers(url):
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(check, timeout, message, process=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and not process.alive:
            raise AssertionError(f"{message}: {process.name} exited\n{process.log()[-4000:]}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{message} (after {timeout} s)" + (f"\n{process.log()[-4000:]}" if process else ""))
