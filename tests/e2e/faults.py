"""Private infrastructure for fault tests: a PostgreSQL cluster and a Redis of their own (so that
restarting them disturbs nothing else), and a small filesystem that fills up.

PostgreSQL refuses to run as root: when the tests run as root, initdb and pg_ctl run as the
`postgres` OS user, in a temporary folder it owns.
"""

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from tests.e2e.stack import free_port


def _as_postgres(args):
    if os.geteuid() != 0:
        return args
    return ["runuser", "-u", "postgres", "--", *args]


class PgCluster:
    """`initdb` in a temporary folder, started on a port of its own; restartable."""

    def __init__(self):
        if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
            raise RuntimeError("initdb and pg_ctl are not on PATH")
        self.folder = Path(tempfile.mkdtemp(prefix="millm-pg-"))
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.folder, owner.pw_uid, owner.pw_gid)
        self.data = self.folder / "data"
        self.log = self.folder / "postgres.log"
        self.port = free_port()
        subprocess.run(
            _as_postgres(["initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"]),
            check=True, capture_output=True,
        )

    @property
    def dsn(self):
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self):
        options = (f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off "
                   f"-c max_connections=200")
        subprocess.run(
            _as_postgres(["pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "-t", "60", "start"]),
            check=True, capture_output=True,
        )

    def stop(self, mode="fast"):
        subprocess.run(_as_postgres(["pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"]),
                       capture_output=True)

    def restart(self, down_s=1.0):
        """An abrupt stop (every connection cut, as in a crash), a pause, a start."""
        self.stop("immediate")
        time.sleep(down_s)
        self.start()

    def ready(self):
        try:
            with psycopg.connect(self.dsn, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def remove(self):
        self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def pg_cluster():
    cluster = PgCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


class RedisServer:
    """redis-server on a port of its own, without persistence; restartable (its data is lost,
    as a restart of a cache-only Redis loses it)."""

    def __init__(self, log_dir):
        self.binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.port = free_port()
        self.log_path = Path(log_dir) / f"redis-{self.port}.log"
        self.popen = None

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"redis-server exited:\n{self.log_path.read_text()[-2000:]}")
            if self.ping():
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer")

    def ping(self):
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self):
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def restart(self, down_s=1.0):
        """SIGKILL, a pause, a start on the same port."""
        self.kill()
        time.sleep(down_s)
        self.start()


@contextlib.contextmanager
def redis_server(log_dir):
    server = RedisServer(log_dir)
    try:
        server.start()
        yield server
    finally:
        server.kill()


@contextlib.contextmanager
def small_disk(folder, size_bytes):
    """A tmpfs of `size_bytes` mounted at `folder` (needs root, or CAP_SYS_ADMIN); unmounted after.

    Raises PermissionError when this machine does not allow the mount.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        raise PermissionError(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        for _ in range(20):
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode == 0:
                break
            time.sleep(0.25)  # a process that has just stopped may still hold a file open
        else:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder, name="filler"):
    """Write zeros into `folder/name` until the filesystem is full; returns the path."""
    path = Path(folder) / name
    block = b"\0" * 65536
    with open(path, "ab", buffering=0) as handle:
        while True:
            try:
                handle.write(block)
            except OSError:
                break
        while True:  # the last few bytes, so that not even a small write fits
            try:
                handle.write(b"\0" * 512)
            except OSError:
                break
        while True:
            try:
                handle.write(b"\0")
            except OSError:
                break
    return path


# --- batch helpers shared by the fault tests ---

COMPLETIONS = "/v1/completions"


def scoring_lines(count, model="tiny-llama", prefix="row"):
    """Scoring rows (one forward pass each, nearly free on the tiny model), eight to a chunk."""
    return [
        {"custom_id": f"{prefix}-{i}", "method": "POST", "url": COMPLETIONS,
         "body": {"model": model, "prompt": f"Item {i}:", "max_tokens": 1, "logprobs": 2}}
        for i in range(count)
    ]


def recorded(stack, batch_id):
    """{line: request_id} of the rows recorded so far, read from the database."""
    return dict(stack.sql("SELECT line, request_id FROM batches_app_batchrow WHERE batch_id = %s "
                          "AND outcome IN ('succeeded', 'failed')", [batch_id]))


def progress(stack, batch_id):
    """(status, completed, failed, claimed_by) straight from the database."""
    return stack.sql("SELECT status, completed, failed, claimed_by FROM batches_app_batch WHERE id = %s", [batch_id])[0]


def live_leases(stack):
    return stack.sql("SELECT holder, model_id FROM inference_app_lease WHERE ended_at IS NULL AND expires_at > now()")


def orphans(stack):
    """Stored bytes no live file record owns, and live records whose bytes are missing."""
    owned = {name for (name,) in stack.sql(
        "SELECT storage_name FROM files_app_file WHERE status IN ('processed', 'error')")}
    stored = {f"files/{name}" for name in stack.stored_files()}
    return sorted(stored - owned), sorted(owned - stored)


def leftover_temporaries(stack):
    """Spool and upload files left in MILLM_DATA_DIR/tmp."""
    folder = stack.data_dir / "tmp"
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []
