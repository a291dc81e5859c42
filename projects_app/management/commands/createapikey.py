"""`manage.py createapikey PROJECT`: a key for PROJECT (made if missing), printed this once."""

from django.core.management.base import BaseCommand

from projects_app.models import ApiKey, Project


class Command(BaseCommand):
    help = "Make an API key for PROJECT (the project is made if missing) and print it; it is never shown again."

    def add_arguments(self, parser):
        parser.add_argument("project", help="The project's name")
        parser.add_argument("--name", default="", help="A label for the key, to recognise it in the admin")
        parser.add_argument("--admin", action="store_true", help="Make the project an admin project (sees everything)")

    def handle(self, *args, project, name, admin, **options):
        owner = Project.objects.named(project, admin=admin)
        if admin and not owner.is_admin:
            Project.objects.filter(pk=owner.pk).update(is_admin=True)
        made, key = ApiKey.objects.issue(owner, name)
        self.stderr.write(f"A key for project {owner.name!r} ({made.hint}); copy it now, it is not shown again:")
        self.stdout.write(key)
