"""Create the PostgreSQL database named by DATABASE_URL if it does not exist yet."""

import psycopg
from django.conf import settings
from django.core.management.base import BaseCommand
from psycopg import sql

from millm_lib.db import conninfo


class Command(BaseCommand):
    help = "Create the database named by DATABASE_URL if it is missing."

    def handle(self, *args, **options):
        name = settings.DATABASES["default"]["NAME"]
        with psycopg.connect(conninfo(dbname="postgres"), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
            if exists:
                self.stdout.write(f"database {name} exists")
                return
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            self.stdout.write(f"created database {name}")
