from django.core.management.base import BaseCommand

from batches_app.retention import run_retention


class Command(BaseCommand):
    help = (
        "Expire files past their expires_at (sparing those an unfinished batch needs), sweep orphaned bytes, "
        "and delete the batches that ended more than BATCH_RETENTION_DAYS ago with their rows."
    )

    def handle(self, *args, **options):
        outcome = run_retention()
        self.stdout.write(
            f"expired {len(outcome['expired'])} file(s), swept {len(outcome['swept'])} orphan(s), "
            f"deleted {outcome['batches_deleted']} batch(es) and {outcome['responses_deleted']} stored response(s) "
            f"in {outcome['seconds']} s"
        )
