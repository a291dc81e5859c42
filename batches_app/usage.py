"""Each project's use of its quotas (SPEC 10d), for the admin and /metrics. Counted by the
aggregates the creates count with under the project's lock (`BATCH_QUOTA_USE` through
`Batch.refuse_over_quotas`, `projects_app.models.stored_bytes` through
`files_app.models.over_file_quota`): unfinished batches, their rows still to run, stored bytes
(files and stored responses)."""

from batches_app.models import BATCH_QUOTA_USE, Batch
from projects_app.models import QUOTAS, Project, stored_bytes


def usage(project):
    """{quota: use} of one project."""
    return {**Batch.objects.filter(project=project).quota_use(),
            "file_bytes": stored_bytes([project.pk])[project.pk]}


def usage_by_project():
    """{project name: {quota: use}} of every project, in grouped queries (one for the batches, one per
    stored-bytes reader, whatever the number of projects)."""
    names = dict(Project.objects.values_list("pk", "name"))
    use = {pk: dict.fromkeys(QUOTAS, 0) for pk in names}
    batches = Batch.objects.unfinished().exclude(project=None).order_by().values("project")
    for row in batches.annotate(**BATCH_QUOTA_USE):
        if row["project"] in use:
            use[row["project"]].update(active_batches=row["active_batches"], queued_rows=row["queued_rows"])
    for pk, stored in stored_bytes(list(use)).items():
        use[pk]["file_bytes"] = stored
    return {names[pk]: figures for pk, figures in use.items()}
