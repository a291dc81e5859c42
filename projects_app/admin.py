from django.contrib import admin
from django.template.response import TemplateResponse

from projects_app.models import QUOTAS, ApiKey, Project

# Each project's use of its quotas, by the apps that know it (batches_app registers its reading:
# this app imports none of them).
usage_readers = []


def usage_of(project):
    use = {}
    for read in usage_readers:
        use.update(read(project))
    return use


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "is_admin", "use", "created_at"]
    search_fields = ["name", "id"]
    readonly_fields = ["id", "created_at", "use"]
    fields = ["id", "name", "is_admin", "max_active_batches", "max_queued_rows", "max_file_bytes", "use", "created_at"]

    def save_model(self, request, obj, form, change):
        if not obj.pk:
            from millm_lib.ids import new_id

            obj.pk = new_id("proj_")
        super().save_model(request, obj, form, change)

    @admin.display(description="use (limit)")
    def use(self, project):
        if project.pk is None:
            return "-"
        use = usage_of(project)
        return ", ".join(f"{quota} {use.get(quota, 0):,} ({_limit(project.limit(quota))})" for quota in QUOTAS)


def _limit(limit):
    return "no limit" if limit is None else f"{limit:,}"


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """A key is made here (or by `manage.py createapikey`) and shown once, on the page that
    answers its creation; it is stored hashed. Revoked, never deleted (the key would then look
    never made) nor edited."""

    list_display = ["hint", "name", "project", "created_at", "revoked_at"]
    list_filter = ["project", "revoked_at"]
    search_fields = ["name", "hint", "project__name"]
    fields = ["project", "name"]
    actions = ["revoke"]

    def get_readonly_fields(self, request, obj=None):
        return ["project", "name", "hint", "created_at", "revoked_at"] if obj is not None else []

    def get_fields(self, request, obj=None):
        return ["project", "name", "hint", "created_at", "revoked_at"] if obj is not None else ["project", "name"]

    def save_model(self, request, obj, form, change):
        made, key = ApiKey.objects.issue(obj.project, obj.name)
        obj.pk, obj.hint = made.pk, made.hint
        request.issued_key = key  # for response_add's page only: never stored, never logged

    def response_add(self, request, obj, post_url_continue=None):
        context = {**self.admin_site.each_context(request), "opts": self.opts, "key": request.issued_key,
                   "api_key": obj, "title": "Copy the new key now"}
        return TemplateResponse(request, "admin/projects_app/apikey/created.html", context)

    @admin.action(description="Revoke the selected keys (refused from the next request on)")
    def revoke(self, request, queryset):
        revoked = sum(key.revoke() for key in queryset)
        self.message_user(request, f"Revoked {revoked} key(s); keys already revoked were left as they were.")

    def has_change_permission(self, request, obj=None):
        return obj is None  # the list and its action; a key's page is for reading

    def has_delete_permission(self, request, obj=None):
        return False
