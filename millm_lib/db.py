"""A libpq connection string for the configured database, for the few places that need a raw
psycopg connection (the engine's advisory lock, creating the database)."""

import psycopg
from django.conf import settings


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
