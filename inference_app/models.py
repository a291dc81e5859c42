import secrets
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone


def new_id(prefix):
    """SPEC 1: a prefix and 24 hex characters."""
    return f"{prefix}{secrets.token_hex(12)}"


class ModelEntry(models.Model):
    """One model of the catalogue: what `/v1/models` lists and requests resolve against."""

    class Kind(models.TextChoices):
        CATALOGUE = "catalogue"
        CHECKPOINT = "checkpoint"

    class Format(models.TextChoices):
        FOLDER = "folder"
        GGUF = "gguf"

    class State(models.TextChoices):
        AVAILABLE = "available"
        LOADING = "loading"
        RESIDENT = "resident"
        UNLOADING = "unloading"
        ERROR = "error"

    id = models.CharField(primary_key=True, max_length=255)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.CATALOGUE)
    source = models.CharField(max_length=1024)
    source_format = models.CharField(max_length=16, choices=Format.choices)
    revision = models.CharField(max_length=128, null=True, blank=True)
    dtype = models.CharField(max_length=16, null=True, blank=True)
    quantization = models.CharField(max_length=32, null=True, blank=True)
    context_length = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.AVAILABLE)
    state_detail = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["created_at", "id"]
        verbose_name = "model"

    def __str__(self):
        return self.id

    def to_openai(self):
        return {"id": self.id, "object": "model", "created": int(self.created_at.timestamp()), "owned_by": "millm"}


class EngineQuerySet(models.QuerySet):
    def live(self):
        return self.filter(heartbeat_at__gte=timezone.now() - timedelta(seconds=settings.ENGINE_STALE_S))

    def active(self):
        return self.filter(role=Engine.Role.ACTIVE)

    def serving(self, model_id):
        """The live active engine whose resident model is `model_id`, if any."""
        return self.live().active().filter(resident_model_id=model_id).order_by("-heartbeat_at").first()


class Engine(models.Model):
    """One `runbatchworker` process: its heartbeat, model, role and queue figures (SPEC 5)."""

    class Role(models.TextChoices):
        ACTIVE = "active"
        STANDBY = "standby"

    class Weights(models.TextChoices):
        CLEAN = "clean"
        TORN = "torn"

    id = models.CharField(primary_key=True, max_length=40)
    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    channel = models.CharField(max_length=100)
    model_id = models.CharField(max_length=255, help_text="The model this engine serves.")
    resident_model_id = models.CharField(max_length=255, null=True, blank=True)
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.STANDBY)
    weights_state = models.CharField(max_length=8, choices=Weights.choices, default=Weights.CLEAN)
    started_at = models.DateTimeField(default=timezone.now)
    heartbeat_at = models.DateTimeField(default=timezone.now)
    queue_waiting = models.PositiveIntegerField(default=0)
    in_flight = models.PositiveIntegerField(default=0)
    queue_max_concurrent = models.PositiveIntegerField(default=1)
    queue_max_pending = models.PositiveIntegerField(default=10)
    estimated_wait_seconds = models.FloatField(null=True, blank=True)
    batch_backlog_rows = models.BigIntegerField(null=True, blank=True)

    objects = EngineQuerySet.as_manager()

    class Meta:
        ordering = ["-heartbeat_at"]

    def __str__(self):
        return f"{self.id} ({self.model_id}, {self.role})"

    @property
    def alive(self):
        return self.heartbeat_at >= timezone.now() - timedelta(seconds=settings.ENGINE_STALE_S)

    def to_health(self):
        return {
            "id": self.id,
            "alive": self.alive,
            "last_heartbeat": int(self.heartbeat_at.timestamp()),
            "model": self.resident_model_id or self.model_id,
            "role": self.role,
        }
