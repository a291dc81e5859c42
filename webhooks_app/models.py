"""Webhook endpoints and the outbox of their deliveries (SPEC 10b).

A batch's end writes one delivery per subscribed endpoint in the transaction that ends it
(`Delivery.objects.enqueue`, called by `Batch.finish`), so a crash between the two loses
nothing. The engine's courier claims due deliveries with SKIP LOCKED and a fencing token, sends
each, and records the answer: a 2xx ends it; a network error, a timeout, a 5xx, 408 or 429 is
tried again after an exponential backoff with jitter (a Retry-After wins) until the retry window
closes; any other answer ends it failed. The delivery's id is the `webhook-id` of every attempt.
"""

import base64
import json
import random
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from millm_lib.ids import new_id
from projects_app.models import DEFAULT_PROJECT, OwnedQuerySet
from millm_lib.pagination import cursor_page

# The event types endpoints may subscribe to, registered by the apps that send them (batches_app:
# its ends, from its config, which runs before anything reads this).
EVENT_TYPES = []
SECRET_PREFIX = "whsec_"
ROTATION_OVERLAP = timedelta(hours=24)
NAME_MAX = 256
CLAIM_MARGIN_S = 5  # beyond the send timeout, before another engine may take a claimed delivery
ERROR_MAX = 500
ANSWER_MAX = 1024


def register_event_types(types):
    """Another app's event types (once per process: app loading may run again in tests)."""
    EVENT_TYPES.extend(event_type for event_type in types if event_type not in EVENT_TYPES)


def stamp(moment):
    return int(moment.timestamp()) if moment else None


class EndpointQuerySet(OwnedQuerySet):
    def subscribed_to(self, event_type):
        return self.filter(event_types__contains=[event_type])

    def hearing(self, project):
        """The endpoints that hear the events of an object of `project`: that project's own
        (an admin project's hear only its own objects too). An object or an endpoint with no
        project is the default project's, as `owned_by` has it."""
        if project is None or project.name == DEFAULT_PROJECT:
            return self.filter(models.Q(project__isnull=True) | models.Q(project__name=DEFAULT_PROJECT))
        return self.filter(project=project)

    def page(self, after=None, limit=20):
        return cursor_page(self, after, limit)


class WebhookEndpoint(models.Model):
    id = models.CharField(primary_key=True, max_length=40)
    name = models.CharField(max_length=NAME_MAX)
    url = models.CharField(max_length=2048)
    event_types = models.JSONField(help_text="The batch.* event types delivered here.")
    # Kept to sign with (HMAC needs the secret itself); the API shows it once, then only a hint.
    secret = models.CharField(max_length=100)
    previous_secret = models.CharField(max_length=100, blank=True, default="")
    previous_secret_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    project = models.ForeignKey("projects_app.Project", null=True, blank=True, on_delete=models.PROTECT,
                                related_name="+", help_text="The project that made it (SPEC 10d).")

    objects = EndpointQuerySet.as_manager()

    class Meta:
        verbose_name = "webhook endpoint"

    def __str__(self):
        return f"{self.name} ({self.url})"

    @classmethod
    def register(cls, name, url, event_types, project=None):
        return cls.objects.create(id=new_id("whep_"), name=name, url=url, event_types=event_types, secret=_new_secret(),
                                  project=project)

    def change(self, **fields):
        """Set the given fields (name, url, event_types); `updated_at` moves only when one changes."""
        changed = {name: value for name, value in fields.items() if getattr(self, name) != value}
        if changed:
            for name, value in changed.items():
                setattr(self, name, value)
            self.updated_at = timezone.now()
            self.save(update_fields=[*changed, "updated_at"])
        return self

    def rotate_secret(self, keep_old=False):
        """A new signing secret; the old one keeps signing beside it for 24 hours when asked."""
        now = timezone.now()
        self.previous_secret, self.previous_secret_until = (self.secret, now + ROTATION_OVERLAP) if keep_old else ("", None)
        self.secret = _new_secret()
        self.updated_at = now
        self.save(update_fields=["secret", "previous_secret", "previous_secret_until", "updated_at"])
        return self

    def remove(self):
        """Delete the endpoint and, with it, its deliveries: a pending one is never sent."""
        self.delete()

    def signing_secrets(self, now=None):
        """The secrets each delivery is signed with now: the current one, and the previous one
        while its overlap lasts (a receiver holding either verifies)."""
        now = now or timezone.now()
        if self.previous_secret and self.previous_secret_until and self.previous_secret_until > now:
            return [self.secret, self.previous_secret]
        return [self.secret]

    @property
    def secret_hint(self):
        return f"{SECRET_PREFIX}…{self.secret[-4:]}"


def _new_secret():
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def event_body(event_type, data, created_at, event_id=None):
    """An event as OpenAI sends it, serialised once: the exact bytes every attempt signs."""
    return json.dumps({"id": event_id or new_id("evt_"), "object": "event", "type": event_type,
                       "created_at": stamp(created_at), "data": data})


class DeliveryQuerySet(models.QuerySet):
    def enqueue(self, event_type, data, created_at, project=None):
        """One event about an object of `project` (None: the default project's), a delivery to
        each of that project's endpoints subscribed to its type; none when nobody is. Call it
        inside the transaction that makes the event true."""
        hearing = WebhookEndpoint.objects.hearing(project).subscribed_to(event_type)
        endpoints = list(hearing.values_list("pk", flat=True))
        if not endpoints:
            return []
        payload = event_body(event_type, data, created_at)
        event_id = json.loads(payload)["id"]
        now = timezone.now()
        give_up_at = now + timedelta(hours=settings.MILLM_WEBHOOK_RETRY_HOURS)
        return Delivery.objects.bulk_create(
            Delivery(id=new_id("wh_"), endpoint_id=endpoint, event_id=event_id, event_type=event_type, payload=payload,
                     created_at=now, next_attempt_at=now, give_up_at=give_up_at)
            for endpoint in endpoints
        )

    def due(self, now):
        return self.filter(status=Delivery.Status.PENDING, next_attempt_at__lte=now).filter(
            models.Q(claimed_until__isnull=True) | models.Q(claimed_until__lt=now)
        )

    def claim_due(self, engine_id, limit=8):
        """Up to `limit` due deliveries, claimed for this engine under one fencing token (SKIP
        LOCKED: two engines never claim the same one). A claim lapses after the send timeout and
        a margin, so a delivery whose engine died is sent again by another (at least once)."""
        now = timezone.now()
        token = new_id("claim_")
        with transaction.atomic():
            ids = list(self.due(now).order_by("next_attempt_at").select_for_update(skip_locked=True)
                       .values_list("pk", flat=True)[:limit])
            if not ids:
                return []
            until = now + timedelta(seconds=settings.MILLM_WEBHOOK_TIMEOUT_S + CLAIM_MARGIN_S)
            Delivery.objects.filter(pk__in=ids).update(claimed_by=engine_id, claim_token=token, claimed_until=until)
        return list(Delivery.objects.filter(claim_token=token).select_related("endpoint").order_by("next_attempt_at"))

    def next_due_at(self):
        """When the first pending delivery may be claimed (its next attempt, or the end of
        another engine's claim on it); None when none is pending."""
        due = Greatest("next_attempt_at", Coalesce("claimed_until", "next_attempt_at"))
        return self.filter(status=Delivery.Status.PENDING).aggregate(first=models.Min(due))["first"]

    def page(self, after=None, limit=20):
        return cursor_page(self, after, limit)


class Delivery(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    id = models.CharField(primary_key=True, max_length=40, help_text="The webhook-id header of every attempt.")
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    event_id = models.CharField(max_length=40)
    event_type = models.CharField(max_length=64)
    payload = models.TextField(help_text="The exact body every attempt sends and signs.")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    give_up_at = models.DateTimeField(help_text="No retry is scheduled past this (MILLM_WEBHOOK_RETRY_HOURS).")
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=ERROR_MAX, blank=True, default="")
    last_answer = models.TextField(blank=True, default="", help_text=f"The first {ANSWER_MAX} bytes of the last answer.")
    claimed_by = models.CharField(max_length=40, null=True, blank=True)
    claim_token = models.CharField(max_length=40, null=True, blank=True)
    claimed_until = models.DateTimeField(null=True, blank=True)

    objects = DeliveryQuerySet.as_manager()

    class Meta:
        verbose_name_plural = "deliveries"
        indexes = [models.Index(fields=["status", "next_attempt_at"], name="webhook_due")]

    def __str__(self):
        return f"{self.event_type} to {self.endpoint_id} ({self.status})"

    def record(self, attempt):
        """The answer to an attempt, fenced by our claim: False (nothing written) when another
        engine took the delivery meanwhile. Returns True when written."""
        fields = dict(attempts=models.F("attempts") + 1, last_attempt_at=attempt.at, last_status_code=attempt.status_code,
                      last_error=attempt.error[:ERROR_MAX], last_answer=attempt.answer[:ANSWER_MAX],
                      claimed_by=None, claim_token=None, claimed_until=None)
        if attempt.delivered:
            fields.update(status=self.Status.SUCCEEDED, delivered_at=attempt.at)
        elif not attempt.retryable:
            fields.update(status=self.Status.FAILED)
        else:
            # Counted from the attempt's end, not its start: after a timeout, the backoff still
            # separates the two attempts.
            ended = timezone.now()
            delay = attempt.retry_after if attempt.retry_after is not None else backoff(self.attempts + 1)
            # Compared in seconds: a receiver's Retry-After of 10^12 s overflows a datetime.
            if delay > (self.give_up_at - ended).total_seconds():
                fields.update(status=self.Status.FAILED, last_error=(
                    f"{attempt.error or f'answered {attempt.status_code}'}; gave up after {self.attempts + 1} "
                    f"attempt(s): the retry window (MILLM_WEBHOOK_RETRY_HOURS) closed")[:ERROR_MAX])
            else:
                fields.update(next_attempt_at=ended + timedelta(seconds=delay))
        return Delivery.objects.filter(pk=self.pk, claim_token=self.claim_token).update(**fields) == 1

    def retry_now(self):
        """The admin's "retry now": due at once, with at least one more attempt even if its
        window has closed."""
        now = timezone.now()
        Delivery.objects.filter(pk=self.pk).exclude(status=self.Status.SUCCEEDED).update(
            status=self.Status.PENDING, next_attempt_at=now, give_up_at=Greatest("give_up_at", now),
            claimed_by=None, claim_token=None, claimed_until=None,
        )



def backoff(attempt):
    """Seconds before attempt `attempt` + 1: MILLM_WEBHOOK_BACKOFF_S doubled per attempt up to
    MILLM_WEBHOOK_BACKOFF_MAX_S, times a jitter of 1 to 1.25 (so each delay still exceeds the
    one before while two receivers' retries spread apart)."""
    base = min(settings.MILLM_WEBHOOK_BACKOFF_MAX_S, settings.MILLM_WEBHOOK_BACKOFF_S * 2 ** (attempt - 1))
    return base * random.uniform(1.0, 1.25)
