import hashlib
import hmac
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from millm_lib.ids import new_id


class ModelEntry(models.Model):
    """One model of the catalogue: what `/v1/models` lists and requests resolve against."""

    class Kind(models.TextChoices):
        CATALOGUE = "catalogue"
        CHECKPOINT = "checkpoint"

    class Format(models.TextChoices):
        FOLDER = "folder"
        GGUF = "gguf"
        CHECKPOINT = "safetensors"  # a checkpoint's tensors, put over its base model

    class Weights(models.TextChoices):
        CLEAN = "clean"
        TORN = "torn"

    class State(models.TextChoices):
        AVAILABLE = "available"
        LOADING = "loading"
        RESIDENT = "resident"
        UNLOADING = "unloading"
        ERROR = "error"

    id = models.CharField(primary_key=True, max_length=255)
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.CATALOGUE)
    base = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="checkpoints",
        help_text="A checkpoint's catalogue model: its weights go over this model's.",
    )
    source = models.CharField(max_length=1024)
    source_format = models.CharField(max_length=16, choices=Format.choices)
    revision = models.CharField(max_length=128, null=True, blank=True)
    dtype = models.CharField(max_length=16, null=True, blank=True)
    quantization = models.CharField(max_length=32, null=True, blank=True)
    context_length = models.PositiveIntegerField(null=True, blank=True)
    hidden_size = models.PositiveIntegerField(null=True, blank=True)
    num_layers = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.AVAILABLE)
    state_detail = models.TextField(blank=True, default="")
    weights_state = models.CharField(
        max_length=8, choices=Weights.choices, default=Weights.CLEAN,
        help_text="torn between a weights begin and its commit; kept across engine restarts.",
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["created_at", "id"]
        verbose_name = "model"

    def __str__(self):
        return self.id

    def to_openai(self):
        return {
            "id": self.id,
            "object": "model",
            "created": int(self.created_at.timestamp()),
            "owned_by": "millm",
            "millm": {"kind": self.kind, "state": self.state},
        }

    @property
    def root(self):
        """The catalogue model whose weights this entry's are (itself, or a checkpoint's base)."""
        return self.base if self.base_id else self

    def new_checkpoint(self, path_of, revision):
        """A resident checkpoint entry `<base id>:ckpt-<n>` for weights saved from this entry (a
        save of a checkpoint's weights is a checkpoint of the same base). `path_of(id)`: where
        its tensors will be."""
        root = self.root
        prefix = f"{root.id}:ckpt-"
        numbers = [int(tail) for tail in
                   (name.removeprefix(prefix) for name in ModelEntry.objects.filter(base=root).values_list("id", flat=True))
                   if tail.isdigit()]
        model_id = f"{prefix}{max(numbers, default=0) + 1}"
        return ModelEntry.objects.create(
            id=model_id,
            kind=ModelEntry.Kind.CHECKPOINT,
            base=root,
            source=str(path_of(model_id)),
            source_format=ModelEntry.Format.CHECKPOINT,
            revision=revision,
            state=ModelEntry.State.RESIDENT,
            dtype=self.dtype,
            quantization=root.quantization,
            context_length=self.context_length,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
        )

    def to_management(self):
        return {
            "id": self.id,
            "kind": self.kind,
            "source": self.source,
            "format": self.source_format,
            "revision": self.revision,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "context_length": self.context_length,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "base": self.base_id,
            "state": self.state,
            "state_detail": self.state_detail or None,
            "weights": self.weights_state,
            "created_at": int(self.created_at.timestamp()),
        }


class EngineQuerySet(models.QuerySet):
    def live(self):
        return self.filter(heartbeat_at__gte=timezone.now() - timedelta(seconds=settings.ENGINE_STALE_S))

    def active(self):
        return self.filter(role=Engine.Role.ACTIVE)

    def serving(self, model_id):
        """The live active engine whose resident model is `model_id`, if any."""
        return self.live().active().filter(resident_model_id=model_id).order_by("-heartbeat_at").first()

    def loading(self, model_id):
        return self.live().active().filter(loading_model_id=model_id).order_by("-heartbeat_at").first()


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
    loading_model_id = models.CharField(max_length=255, null=True, blank=True)
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
            "resident_model": self.resident_model_id,
            "loading_model": self.loading_model_id,
            "weights": self.weights_state,
        }


def hash_lease_id(lease_id):
    return hashlib.sha256(lease_id.encode()).hexdigest()


class LeaseQuerySet(models.QuerySet):
    def live(self):
        return self.filter(ended_at__isnull=True, expires_at__gt=timezone.now())

    def on_model(self, model_id):
        return self.live().filter(model_id=model_id).first()

    def find(self, lease_id):
        """The lease a presented id names, live or not; ids are stored hashed."""
        digest = hash_lease_id(lease_id)
        lease = self.filter(id_hash=digest).first()
        # The lookup is by hash; the comparison is constant-time all the same.
        if lease is not None and hmac.compare_digest(lease.id_hash, digest):
            return lease
        return None

    def end_all(self, reason, **filters):
        return self.filter(ended_at__isnull=True, **filters).update(ended_at=timezone.now(), end_reason=reason)


class Lease(models.Model):
    """A holder's claim on a resident model: blocks others' load, unload and swap (SPEC 6)."""

    id_hash = models.CharField(max_length=64, unique=True)
    model_id = models.CharField(max_length=255)
    engine_id = models.CharField(max_length=40)
    holder = models.CharField(max_length=128)
    reason = models.CharField(max_length=512)
    ttl_seconds = models.PositiveIntegerField()
    acquired_at = models.DateTimeField(default=timezone.now)
    renewed_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    end_reason = models.CharField(max_length=64, blank=True, default="")

    objects = LeaseQuerySet.as_manager()

    class Meta:
        ordering = ["-acquired_at"]
        indexes = [models.Index(fields=["model_id", "ended_at"])]

    def __str__(self):
        return f"{self.holder} on {self.model_id}"

    @classmethod
    def acquire(cls, engine, model_id, holder, reason, ttl_seconds):
        """Returns (lease, its id) or (the live lease that blocks, None).

        The engine row is locked so two callers cannot both see "no live lease" and both take one.
        """
        with transaction.atomic():
            Engine.objects.select_for_update().filter(pk=engine.pk).first()
            blocking = cls.objects.filter(engine_id=engine.pk).live().first() or cls.objects.on_model(model_id)
            if blocking is not None:
                return blocking, None
            lease_id = new_id("lease_") + secrets.token_hex(8)
            now = timezone.now()
            lease = cls.objects.create(
                id_hash=hash_lease_id(lease_id),
                model_id=model_id,
                engine_id=engine.pk,
                holder=holder,
                reason=reason,
                ttl_seconds=ttl_seconds,
                acquired_at=now,
                renewed_at=now,
                expires_at=now + timedelta(seconds=ttl_seconds),
            )
            return lease, lease_id

    @property
    def live(self):
        return self.ended_at is None and self.expires_at > timezone.now()

    def why_ended(self):
        if self.ended_at is not None:
            return self.end_reason or "released"
        return "expired" if self.expires_at <= timezone.now() else None

    def renew(self):
        """Compare-and-set on 'still live': a lease that ended meanwhile is not revived."""
        now = timezone.now()
        expires = now + timedelta(seconds=self.ttl_seconds)
        updated = Lease.objects.live().filter(pk=self.pk).update(renewed_at=now, expires_at=expires)
        if updated:
            self.renewed_at, self.expires_at = now, expires
        return bool(updated)

    def release(self):
        return bool(Lease.objects.end_all("released", pk=self.pk))

    def status(self):
        now = timezone.now()
        return {
            "model_id": self.model_id,
            "holder": self.holder,
            "reason": self.reason,
            "acquired_at": int(self.acquired_at.timestamp()),
            "renewed_at": int(self.renewed_at.timestamp()),
            "expires_at": int(self.expires_at.timestamp()),
            "ttl_seconds": self.ttl_seconds,
            "seconds_remaining": max(0, int((self.expires_at - now).total_seconds())),
        }

    def describe(self):
        """For refusals: holder, reason and expiry, never the id."""
        return (
            f"held by '{self.holder}' ({self.reason}) until "
            f"{self.expires_at.strftime('%Y-%m-%dT%H:%M:%SZ')}"
        )


class Probe(models.Model):
    """A linear read-out of the residual stream after decoder block `layer` (SPEC 4)."""

    class Aggregation(models.TextChoices):
        MEAN = "mean"
        MAX = "max"
        LAST = "last"

    id = models.CharField(primary_key=True, max_length=40)
    name = models.CharField(max_length=128)
    model_id = models.CharField(max_length=255)
    layer = models.PositiveIntegerField()
    weights = models.JSONField()
    bias = models.FloatField(default=0.0)
    norm_mean = models.JSONField(help_text="A scalar or a d_model vector.")
    norm_std = models.JSONField(help_text="A scalar or a d_model vector.")
    aggregation = models.CharField(max_length=8, choices=Aggregation.choices)
    threshold = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.name} ({self.model_id}, layer {self.layer})"

    def summary(self):
        return {
            "id": self.id,
            "name": self.name,
            "model": self.model_id,
            "layer": self.layer,
            "d_model": len(self.weights),
            "aggregation": self.aggregation,
            "threshold": self.threshold,
            "created_at": int(self.created_at.timestamp()),
        }

    def detail(self):
        return {**self.summary(), "weights": self.weights, "bias": self.bias, "norm_mean": self.norm_mean, "norm_std": self.norm_std}

    def spec(self):
        """What the engine needs to score it."""
        return {
            "id": self.id,
            "name": self.name,
            "layer": self.layer,
            "weights": self.weights,
            "bias": self.bias,
            "norm_mean": self.norm_mean,
            "norm_std": self.norm_std,
            "aggregation": self.aggregation,
            "threshold": self.threshold,
        }
