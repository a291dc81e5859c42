"""Each project's use of its quotas (SPEC 10d), for the admin and /metrics. The figures are the
querysets the creates count under the project's lock (`Batch.refuse_over_quotas`,
`files_app.models.over_file_quota`): unfinished batches, their QUEUED_ROWS, stored files' bytes."""

from django.db.models import Count, Sum

from batches_app.models import QUEUED_ROWS, Batch
from files_app.models import File
from projects_app.models import QUOTAS, Project


def usage(project):
    """{quota: use} of one project."""
    batches = Batch.objects.filter(project=project).unfinished()
    return {
        "active_batches": batches.count(),
        "queued_rows": batches.queued_rows(),
        "file_bytes": File.objects.filter(project=project).stored_bytes(),
    }


def usage_by_project():
    """{project name: {quota: use}} of every project, in three grouped queries (whatever the
    number of projects)."""
    names = dict(Project.objects.values_list("pk", "name"))
    use = {pk: dict.fromkeys(QUOTAS, 0) for pk in names}
    batches = Batch.objects.unfinished().exclude(project=None).order_by().values_list("project")
    for pk, active, rows in batches.annotate(active=Count("id"), rows=Sum(QUEUED_ROWS)):
        if pk in use:
            use[pk].update(active_batches=active, queued_rows=rows or 0)
    files = File.objects.stored().exclude(project=None).order_by().values_list("project")
    for pk, stored in files.annotate(stored=Sum("bytes")):
        if pk in use:
            use[pk]["file_bytes"] = stored or 0
    return {names[pk]: figures for pk, figures in use.items()}
