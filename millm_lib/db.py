"""The database from outside Django's request cycle: a libpq connection string for the few
places that need a raw psycopg connection (the engine's advisory lock, creating the database),
and the web process's small pool of threads for database reads (`on_db_pool`)."""

import functools
from concurrent.futures import ThreadPoolExecutor

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections


def conninfo(dbname=None):
    db = settings.DATABASES["default"]
    parts = {
        "dbname": dbname or db["NAME"],
        "user": db.get("USER"),
        "password": db.get("PASSWORD"),
        "host": db.get("HOST"),
        "port": db.get("PORT"),
    }
    return psycopg.conninfo.make_conninfo(**{key: str(value) for key, value in parts.items() if value})


# Web's database reads (forwarding, the middleware's checks) run on a few threads shared by every
# request. On the request's own thread (Django's ASGI handler gives each request one), each
# waiting request would hold a database connection until it ends: 100 requests queued at the
# engine would hold 100, past PostgreSQL's max_connections, and be refused for that instead of
# answered.
DB_POOL_THREADS = 4
db_pool = ThreadPoolExecutor(DB_POOL_THREADS, thread_name_prefix="gateway-db")


def on_db_pool(func):
    @functools.wraps(func)
    def run(*args, **kwargs):
        close_old_connections()  # a pooled thread has no request signals: replace a dropped connection here
        return func(*args, **kwargs)

    return sync_to_async(run, thread_sensitive=False, executor=db_pool)
