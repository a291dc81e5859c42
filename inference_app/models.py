import hashlib
import hmac
import secrets
from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.utils import timezone

from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from projects_app.models import OwnedQuerySet
from inference_app.shapes import (
    CatalogueEntry,
    EngineHealth,
    LeaseStatus,
    ModelMillm,
    ModelObject,
    ProbeDetail,
    ProbeSummary,
)

ENGINE_ROW_RETENTION = timedelta(days=1)  # a dead engine's row stays this long for /health/detailed


def _source_fields(source):
    """The entry fields a `catalogue.ModelSource` gives."""
    return {"source": str(source.path), "source_format": source.format, "quantization": source.quantization,
            "chat_template": source.chat_template}


class ModelEntryQuerySet(models.QuerySet):
    def register(self, source):
        """A new catalogue entry for `source` (a `catalogue.ModelSource`); IntegrityError when
        its id is taken."""
        return self.create(id=source.model_id, **_source_fields(source))

    def record_engine_model(self, source):
        """The entry of an engine's own model (MILLM_MODEL): made, or brought up to its source."""
        entry, _ = self.update_or_create(id=source.model_id, defaults=_source_fields(source))
        return entry

    def release_unserved(self):
        """At an engine's start-up: entries a dead engine left resident, loading or unloading,
        and that no live engine serves, are available again."""
        serving = Engine.objects.live().exclude(resident_model_id=None).values_list("resident_model_id", flat=True)
        self.filter(state__in=["resident", "loading", "unloading"]).exclude(id__in=list(serving)).update(
            state=ModelEntry.State.AVAILABLE
        )

    def release_unless_served(self, model_id, engine_id):
        """`engine_id` no longer has `model_id` resident: it is available again unless another
        live engine still has it resident."""
        if not Engine.objects.live().exclude(pk=engine_id).filter(resident_model_id=model_id).exists():
            self.filter(pk=model_id).update(state=ModelEntry.State.AVAILABLE)

    def set_weights(self, model_id, state):
        self.filter(pk=model_id).update(weights_state=state)

    def probe_reference(self, model_id):
        """The entry a probe made for `model_id` is checked against: that model when a live
        active engine serves it, else the first resident model; None when none is resident."""
        if Engine.objects.serving(model_id) is not None:
            return self.get(pk=model_id)
        residents = [engine.resident_model_id for engine in Engine.objects.live().active() if engine.resident_model_id]
        return self.get(pk=residents[0]) if residents else None


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
    chat_template = models.CharField(
        max_length=1024, null=True, blank=True,
        help_text="The chat template it chats with over its own: a well-known name or a Jinja file's path.",
    )
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

    objects = ModelEntryQuerySet.as_manager()

    class Meta:
        ordering = ["created_at", "id"]
        verbose_name = "model"

    def __str__(self):
        return self.id

    @property
    def requests_may_load(self):
        """A request may make a catalogue model resident; a checkpoint only an explicit load."""
        return self.kind != ModelEntry.Kind.CHECKPOINT

    def mark_loading(self):
        ModelEntry.objects.filter(pk=self.pk).update(state=ModelEntry.State.LOADING, state_detail="")

    def mark_load_failed(self, error):
        ModelEntry.objects.filter(pk=self.pk).update(state=ModelEntry.State.ERROR, state_detail=str(error)[:2000])

    def mark_resident(self, torn, revision, dtype, context_length, hidden_size, num_layers):
        """Loaded: resident, with what the load found out (its shape, dtype and revision)."""
        ModelEntry.objects.filter(pk=self.pk).update(
            weights_state=ModelEntry.Weights.TORN if torn else ModelEntry.Weights.CLEAN,
            state=ModelEntry.State.RESIDENT,
            revision=revision,
            dtype=dtype,
            context_length=context_length,
            hidden_size=hidden_size,
            num_layers=num_layers,
        )

    def probe_mismatches(self, probe):
        """Every field of a probe import (model, layer, weights, norm_mean, norm_std) that does
        not fit this model, with what it expected: [{"field", "expected", "actual"}]."""
        mismatches = []
        if probe.model != self.pk:
            mismatches.append({"field": "model", "expected": self.pk, "actual": probe.model})
        if probe.layer >= self.num_layers:
            mismatches.append({"field": "layer", "expected": f"0..{self.num_layers - 1}", "actual": probe.layer})
        if len(probe.weights) != self.hidden_size:
            mismatches.append({"field": "weights", "expected": self.hidden_size, "actual": len(probe.weights)})
        for name in ("norm_mean", "norm_std"):
            value = getattr(probe, name)
            if isinstance(value, list) and len(value) != self.hidden_size:
                mismatches.append({"field": name, "expected": self.hidden_size, "actual": len(value)})
        return mismatches

    def to_openai(self):
        return ModelObject(
            id=self.id,
            object="model",
            created=int(self.created_at.timestamp()),
            owned_by="millm",
            millm=ModelMillm(kind=self.kind, state=self.state),
        )

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
        return CatalogueEntry(
            id=self.id,
            kind=self.kind,
            source=self.source,
            format=self.source_format,
            revision=self.revision,
            dtype=self.dtype,
            quantization=self.quantization,
            chat_template=self.chat_template,
            context_length=self.context_length,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            base=self.base_id,
            state=self.state,
            state_detail=self.state_detail or None,
            weights=self.weights_state,
            created_at=int(self.created_at.timestamp()),
        )


class EngineQuerySet(models.QuerySet):
    def live(self):
        return self.filter(heartbeat_at__gte=timezone.now() - timedelta(seconds=settings.ENGINE_STALE_S))

    def active(self):
        return self.filter(role=Engine.Role.ACTIVE)

    def running(self):
        """Live and active: the engines that may hold a batch's or a row's claim. A standby, a
        row demoted for a lost seat and a silent process hold none."""
        return self.live().active()

    def replicas(self, model_id):
        """The running engines started for `model_id` (its replicas, SPEC 10c)."""
        return self.running().filter(model_id=model_id)

    def serving(self, model_id):
        """The live active engine whose resident model is `model_id`, if any."""
        return self.live().active().filter(resident_model_id=model_id).order_by("-heartbeat_at").first()

    # --- an engine's own row: only that engine writes it ---

    def register(self, engine_id, host, pid, channel, model_id, max_concurrent, max_pending):
        """A starting engine's row, as a standby; rows silent for ENGINE_ROW_RETENTION go first."""
        self.filter(heartbeat_at__lt=timezone.now() - ENGINE_ROW_RETENTION).delete()
        return self.create(
            id=engine_id,
            host=host,
            pid=pid,
            channel=channel,
            model_id=model_id,
            role=Engine.Role.STANDBY,
            queue_max_concurrent=max_concurrent,
            queue_max_pending=max_pending,
        )

    def take_over(self, engine_id, model_id, seat=0):
        """`engine_id` holds the advisory lock of `model_id`'s `seat`: it is an active engine.

        Holding the lock, another row active on this seat (or a row from before seats) is a dead
        process (or one that lost the lock and is stopping): it serves nothing from now on,
        whatever its last heartbeat says, and requests are not routed to it while it goes stale.
        """
        self.demote(self.filter(model_id=model_id).filter(models.Q(seat=seat) | models.Q(seat__isnull=True))
                    .exclude(pk=engine_id))
        self.filter(pk=engine_id).update(role=Engine.Role.ACTIVE, seat=seat, heartbeat_at=timezone.now())

    def demote(self, rows):
        return rows.filter(role=Engine.Role.ACTIVE).update(
            role=Engine.Role.STANDBY, resident_model_id=None, loading_model_id=None, swapping=False
        )

    def seated_peers(self, model_id, engine_id):
        """(id, seat) of the other live active replicas of `model_id`: the ones a replica checks
        for a freed seat (PostgreSQL frees a dead session's lock at once, long before its
        heartbeat goes stale)."""
        return list(self.running().filter(model_id=model_id, seat__isnull=False).exclude(pk=engine_id)
                    .values_list("pk", "seat"))

    def report_heartbeat(self, engine_id, **figures):
        """Write the heartbeat and queue figures; False when the row is gone (deleted by an
        operator or a test flush), for the engine to register again."""
        return bool(self.filter(pk=engine_id).update(**figures))

    def unregister(self, engine_id):
        self.filter(pk=engine_id).delete()

    def begin_swap(self, engine_id, model_id):
        """A load of `model_id` (None: an unload) begins: the engine serves no batch until it ends."""
        self.filter(pk=engine_id).update(swapping=True, loading_model_id=model_id)

    def end_swap(self, engine_id):
        self.filter(pk=engine_id).update(swapping=False, loading_model_id=None)

    def serving_batches(self):
        """The live active engines whose resident model runs batch rows now: not mid-swap."""
        return self.live().active().exclude(resident_model_id=None).filter(swapping=False)

    def set_loading(self, engine_id, model_id):
        """`model_id`: the model the engine is loading now, or None when that load ended."""
        self.filter(pk=engine_id).update(loading_model_id=model_id)

    def mark_resident(self, engine_id, model_id, torn):
        """A load finished: the engine is active with `model_id` resident."""
        self.filter(pk=engine_id).update(
            role=Engine.Role.ACTIVE, resident_model_id=model_id, loading_model_id=None, heartbeat_at=timezone.now(),
            weights_state=Engine.Weights.TORN if torn else Engine.Weights.CLEAN,
        )

    def set_resident(self, engine_id, model_id):
        """`model_id`: the id the resident weights answer under now (a save renames them), or
        None once unloaded."""
        self.filter(pk=engine_id).update(resident_model_id=model_id)

    def set_weights(self, engine_id, state):
        self.filter(pk=engine_id).update(weights_state=state)


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
    swapping = models.BooleanField(default=False, help_text="A load, unload or swap is under way: the batches of "
                                   "the models it changes wait as model_not_resident until it ends.")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.STANDBY)
    weights_state = models.CharField(max_length=8, choices=Weights.choices, default=Weights.CLEAN)
    started_at = models.DateTimeField(default=timezone.now)
    heartbeat_at = models.DateTimeField(default=timezone.now)
    queue_waiting = models.PositiveIntegerField(default=0)
    in_flight = models.PositiveIntegerField(default=0)
    queue_max_concurrent = models.PositiveIntegerField(default=1)
    queue_max_pending = models.PositiveIntegerField(default=10)
    estimated_wait_seconds = models.FloatField(null=True, blank=True)
    sequences_running = models.PositiveIntegerField(default=0, help_text="Sequences the step scheduler decodes (0 on a serial engine).")
    queue_waits_total = models.BigIntegerField(default=0, help_text="Interactive requests granted a seat.")
    queue_wait_seconds_total = models.FloatField(default=0.0, help_text="The seconds they waited for it, in all.")
    prefix_tokens_reused_total = models.BigIntegerField(
        default=0, help_text="Prompt tokens this engine process served from a cached prefix (prefix reuse).")
    prefix_cache_bytes = models.BigIntegerField(default=0, help_text="Bytes its prefix cache holds now.")
    seat = models.PositiveIntegerField(null=True, blank=True, help_text="Its model's replica seat, while active (SPEC 10c).")
    batch_work = models.JSONField(null=True, blank=True, help_text="The batch it runs rows of: {batch, role, rows_run}.")

    objects = EngineQuerySet.as_manager()

    class Meta:
        ordering = ["-heartbeat_at"]

    def __str__(self):
        return f"{self.id} ({self.model_id}, {self.role})"

    @property
    def alive(self):
        return self.heartbeat_at >= timezone.now() - timedelta(seconds=settings.ENGINE_STALE_S)

    def to_health(self):
        return EngineHealth(
            id=self.id,
            alive=self.alive,
            last_heartbeat=int(self.heartbeat_at.timestamp()),
            model=self.resident_model_id or self.model_id,
            role=self.role,
            resident_model=self.resident_model_id,
            loading_model=self.loading_model_id,
            weights=self.weights_state,
            seat=self.seat,
            queue_waiting=self.queue_waiting,
            in_flight=self.in_flight,
            sequences_running=self.sequences_running,
            batch_work=self.batch_work,
        )


def hash_lease_id(lease_id):
    return hashlib.sha256(lease_id.encode()).hexdigest()


class LeaseQuerySet(OwnedQuerySet):
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

    def forget_on_restart(self, model_id, engine_id):
        """An engine's start-up ends every lease on its model and every lease of an engine no
        longer live: they are deleted, so a renew answers 404 lease_not_found. A model another
        running replica serves keeps its leases: a lease binds all its replicas (SPEC 10c), and
        one replica's restart is not the model's."""
        served = set(Engine.objects.running().exclude(pk=engine_id).exclude(resident_model_id=None)
                     .values_list("resident_model_id", flat=True))
        live = list(Engine.objects.live().values_list("pk", flat=True))
        if model_id not in served:
            self.filter(model_id=model_id).delete()
        self.exclude(engine_id__in=live).exclude(model_id__in=served).delete()

    def end_unless_served(self, reason, model_id, engine_id):
        """`engine_id` stops serving `model_id`: its leases end, unless another running replica
        still serves it."""
        if not Engine.objects.running().exclude(pk=engine_id).filter(resident_model_id=model_id).exists():
            self.end_all(reason, model_id=model_id)

    def follow_rename(self, model_id, renamed_to):
        """A save renamed the resident weights: the live leases on them follow. Only live ones:
        a lease that ended or expired meanwhile keeps the id it was taken on, as its holder saw it."""
        self.live().filter(model_id=model_id).update(model_id=renamed_to)


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
    project = models.ForeignKey("projects_app.Project", null=True, blank=True, on_delete=models.PROTECT,
                                related_name="+", help_text="The project that made it (SPEC 10d).")

    objects = LeaseQuerySet.as_manager()

    class Meta:
        ordering = ["-acquired_at"]
        indexes = [models.Index(fields=["model_id", "ended_at"])]

    def __str__(self):
        return f"{self.holder} on {self.model_id}"

    @classmethod
    def acquire(cls, engine, model_id, holder, reason, ttl_seconds, project=None):
        """Returns (lease, its id) or (the live lease that blocks, None). The lease is `project`'s;
        a live lease blocks whichever project holds it.

        The model's catalogue row is locked so two callers cannot both see "no live lease" and
        both take one, whichever of the model's replicas each reached; the engine's row too, for a
        model not (yet) in the catalogue.
        """
        with transaction.atomic():
            ModelEntry.objects.select_for_update().filter(pk=model_id).first()
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
                project=project,
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
        return LeaseStatus(
            model_id=self.model_id,
            holder=self.holder,
            reason=self.reason,
            acquired_at=int(self.acquired_at.timestamp()),
            renewed_at=int(self.renewed_at.timestamp()),
            expires_at=int(self.expires_at.timestamp()),
            ttl_seconds=self.ttl_seconds,
            seconds_remaining=max(0, int((self.expires_at - now).total_seconds())),
        )

    def describe(self):
        """For refusals: holder, reason and expiry, never the id."""
        return (
            f"held by '{self.holder}' ({self.reason}) until "
            f"{self.expires_at.strftime('%Y-%m-%dT%H:%M:%SZ')}"
        )


class ProbeQuerySet(OwnedQuerySet):
    def import_probe(self, probe, project=None):
        """A new probe of `project` from a probe import (`schemas.ProbeImport`), under a new id."""
        return self.create(
            id=new_id("probe_"),
            name=probe.name,
            model_id=probe.model,
            layer=probe.layer,
            weights=list(probe.weights),
            bias=probe.bias,
            norm_mean=probe.norm_mean if isinstance(probe.norm_mean, float) else list(probe.norm_mean),
            norm_std=probe.norm_std if isinstance(probe.norm_std, float) else list(probe.norm_std),
            aggregation=probe.aggregation,
            threshold=probe.threshold,
            project=project,
        )

    def model_of(self, probe_ids):
        """The one model the probes `probe_ids` were made for (None when none is named);
        refused when one is unknown or they belong to different models."""
        if not probe_ids:
            return None
        models_by_id = dict(self.filter(pk__in=probe_ids).values_list("pk", "model_id"))
        missing = [probe_id for probe_id in probe_ids if probe_id not in models_by_id]
        if missing:
            raise ApiError(404, "probe_not_found", f"No probe has the id '{missing[0]}'", details={"field": "probe_ids"})
        if len(set(models_by_id.values())) > 1:
            raise ApiError(
                400, "invalid_probe_score_request", "The probes named belong to different models; score them apart",
                details={"field": "probe_ids"},
            )
        return next(iter(models_by_id.values()))


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
    project = models.ForeignKey("projects_app.Project", null=True, blank=True, on_delete=models.PROTECT,
                                related_name="+", help_text="The project that made it (SPEC 10d).")

    objects = ProbeQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self):
        return f"{self.name} ({self.model_id}, layer {self.layer})"

    def summary(self):
        return ProbeSummary(
            id=self.id,
            name=self.name,
            model=self.model_id,
            layer=self.layer,
            d_model=len(self.weights),
            aggregation=self.aggregation,
            threshold=self.threshold,
            created_at=int(self.created_at.timestamp()),
        )

    def detail(self):
        return ProbeDetail(**self.summary(), weights=self.weights, bias=self.bias, norm_mean=self.norm_mean,
                           norm_std=self.norm_std)

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
