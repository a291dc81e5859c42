"""Each project's use of its quotas (SPEC 10d), for the admin and /metrics. Counted by the
aggregates the creates count with under the project's lock (`BATCH_QUOTA_USE` through
`Batch.refuse_over_quotas`, `FILE_QUOTA_USE` through `files_app.models.over_file_quota`): unfinished
batches, their rows still to run, stored files' bytes."""

from batches_app.models import BATCH_QUOTA_USE, Batch
from files_app.models import FILE_QUOTA_USE, File
from projects_app.models import QUOTAS, Project


def usage(project):
    """{quota: use} of one project."""
    return {**Batch.objects.filter(project=project).quota_use(),
            "file_bytes": File.objects.filter(project=project).stored_bytes()}


def usage_by_project():
    """{project name: {quota: use}} of every project, in three grouped queries (whatever the
    number of projects)."""
    names = dict(Project.objects.values_list("pk", "name"))
    use = {pk: dict.fromkeys(QUOTAS, 0) for pk in names}
    batches = Batch.objects.unfinished().exclude(project=None).order_by().values("project")
    for row in batches.annotate(**BATCH_QUOTA_USE):
        if row["project"] in use:
            use[row["project"]].update(active_batches=row["active_batches"], queued_rows=row["queued_rows"])
    files = File.objects.stored().exclude(project=None).order_by().values_list("project")
    for pk, stored in files.annotate(stored=FILE_QUOTA_USE):
        if pk in use:
            use[pk]["file_bytes"] = stored
    return {names[pk]: figures for pk, figures in use.items()}
