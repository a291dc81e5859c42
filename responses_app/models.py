"""Stored responses (issue 30): what `POST /v1/responses` answered, kept (unless `store: false`)
for `GET`, `DELETE`, `input_items` and `previous_response_id`, owned by the caller's project and
purged after RESPONSES_RETENTION_DAYS.

A stored response keeps its whole conversation: `input_items` are every item the model read
(the chain it continued, then its own input) and `body` is the response object, whose `output`
follows them. Chaining from it reads this one row: a deleted or purged ancestor breaks nothing.
Its `bytes` (the two as JSON) count against the project's `file_bytes` quota (stored bytes).
"""

import json
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.db.models import Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from millm_lib.errors import ApiError
from projects_app.models import OwnedQuerySet

STORED_USE = Coalesce(Sum("bytes"), 0)  # the stored-bytes quota's use, as an aggregate


def response_not_found(response_id):
    return ApiError(404, "response_not_found", f"No response has the id '{response_id}'", param="response_id")


class StoredResponseQuerySet(OwnedQuerySet):
    def stored_bytes(self):
        return self.aggregate(total=STORED_USE)["total"]

    def purge_expired(self, now=None):
        """Delete the responses older than RESPONSES_RETENTION_DAYS; returns how many went."""
        return self.filter(expires_at__lte=now or timezone.now()).delete()[0]

    def found(self, response_id, project):
        """The caller's stored response `response_id`; another project's is as unknown (404)."""
        found = self.owned_by(project).filter(pk=response_id).first()
        if found is None:
            raise response_not_found(response_id)
        return found


def responses_stored_bytes(project_ids):
    """{project id: its stored responses' bytes}: this app's reader of the file_bytes quota."""
    stored = StoredResponse.objects.filter(project__in=project_ids).order_by().values_list("project")
    return dict(stored.annotate(stored=STORED_USE))


class StoredResponse(models.Model):
    id = models.CharField(primary_key=True, max_length=40)
    project = models.ForeignKey("projects_app.Project", null=True, blank=True, on_delete=models.CASCADE,
                                related_name="+", help_text="The project that made it (SPEC 10d).")
    status = models.CharField(max_length=16)
    body = models.JSONField(help_text="The response object, as it was answered.")
    input_items = models.JSONField(help_text="Every item the model read: the chain it continued, then its input.")
    bytes = models.BigIntegerField(help_text="The body and the input items as JSON: the stored-bytes quota's use.")
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(db_index=True)

    objects = StoredResponseQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    @classmethod
    def keep(cls, body, input_items, project):
        size = len(json.dumps(body)) + len(json.dumps(input_items))
        now = timezone.now()
        return cls.objects.create(
            id=body["id"], project=project, status=body["status"], body=body, input_items=input_items, bytes=size,
            created_at=now, expires_at=now + timedelta(days=settings.RESPONSES_RETENTION_DAYS),
        )

    def conversation(self):
        """The items a response chained from this one continues: what it read, then its output."""
        return [*self.input_items, *self.body["output"]]
