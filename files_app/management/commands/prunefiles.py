from django.core.management.base import BaseCommand

from files_app.retention import run_retention


class Command(BaseCommand):
    help = "Expire files past their expires_at (sparing those an unfinished batch needs) and sweep orphaned bytes."

    def handle(self, *args, **options):
        outcome = run_retention()
        self.stdout.write(
            f"expired {len(outcome['expired'])} file(s), swept {len(outcome['swept'])} orphan(s) in {outcome['seconds']} s"
        )
