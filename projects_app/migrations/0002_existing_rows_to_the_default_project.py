"""Rows made before projects existed belong to the default project (MILLM_API_KEYS' keys and the
open server), so that an existing set-up sees all it saw before."""

from django.db import migrations

OWNED = [("files_app", "File"), ("batches_app", "Batch"), ("inference_app", "Lease"), ("inference_app", "Probe"),
         ("webhooks_app", "WebhookEndpoint")]


def to_default(apps, schema_editor):
    Project = apps.get_model("projects_app", "Project")
    models = [apps.get_model(app, name) for app, name in OWNED]
    if not any(model.objects.filter(project__isnull=True).exists() for model in models):
        return
    import secrets

    default, _ = Project.objects.get_or_create(name="default", defaults={"id": f"proj_{secrets.token_hex(12)}"})
    for model in models:
        model.objects.filter(project__isnull=True).update(project=default)


class Migration(migrations.Migration):
    dependencies = [
        ("projects_app", "0001_initial"),
        ("files_app", "0002_file_project"),
        ("batches_app", "0004_batch_project"),
        ("inference_app", "0005_lease_project_probe_project"),
        ("webhooks_app", "0002_webhookendpoint_project"),
    ]
    operations = [migrations.RunPython(to_default, migrations.RunPython.noop)]
