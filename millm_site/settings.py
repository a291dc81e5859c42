"""miServer settings: every value from the environment (SPEC section 11).

A bad value raises ImproperlyConfigured naming the variable, so start-up stops at once.
"""

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from millm_site.env import envbool, envchoice, envfloat, envint, envlist, envstr

BASE_DIR = Path(__file__).resolve().parent.parent
VERSION = "0.1.0"

SECRET_KEY = envstr("DJANGO_SECRET_KEY", "millm-insecure-development-key-set-DJANGO_SECRET_KEY")
DEBUG = envbool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = envlist("DJANGO_ALLOWED_HOSTS") or ["*"]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "projects_app",
    "inference_app",
    "files_app",
    "batches_app",
    "webhooks_app",
    "responses_app",
]

MIDDLEWARE = [
    # nosniff, the referrer policy, HSTS and the HTTPS redirect behind TLS, on every response.
    "django.middleware.security.SecurityMiddleware",
    "millm_site.middleware.RequestIdMiddleware",
    "millm_site.middleware.ApiErrorMiddleware",
    # Session, common, auth and messages: for /admin/ only (the API uses none).
    "millm_site.middleware.AdminMiddleware",
    # The staff-session routes (the admin) need a CSRF token; every bearer-key route is exempt,
    # as DRF exempts its views (tests/test_deploy_checks.py walks the routes).
    "django.middleware.csrf.CsrfViewMiddleware",
    "millm_site.middleware.ApiKeyMiddleware",
    "millm_site.middleware.UrlGuardMiddleware",
    # X-Frame-Options: DENY: the admin's buttons (cancel a batch, end a lease) cannot be framed.
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# Behind a proxy that terminates TLS (README, "Before production"): the proxy's
# X-Forwarded-Proto says the request came over HTTPS; cookies go over HTTPS only; HSTS tells
# browsers to use nothing else; plain HTTP is redirected, except the probes and the scrape that
# orchestrators send to the pod itself.
BEHIND_TLS = envbool("DJANGO_BEHIND_TLS", False)
if BEHIND_TLS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^api/health", r"^metrics$"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = envint("DJANGO_HSTS_SECONDS", 31_536_000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = envbool("DJANGO_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = envbool("DJANGO_HSTS_PRELOAD", True)
X_FRAME_OPTIONS = "DENY"
CSRF_TRUSTED_ORIGINS = envlist("DJANGO_CSRF_TRUSTED_ORIGINS")

# The admin's checks look for its middleware in MIDDLEWARE; AdminMiddleware runs them for it.
SILENCED_SYSTEM_CHECKS = ["admin.E408", "admin.E409", "admin.E410"]

ROOT_URLCONF = "millm_site.urls"
ASGI_APPLICATION = "millm_site.asgi.application"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # Inside the package, so an installed wheel (not only a checkout) has the admin's pages.
        "DIRS": [Path(__file__).resolve().parent / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# PostgreSQL only: the batch runner relies on SKIP LOCKED, advisory locks and row-level
# compare-and-set, none of which another database gives the same way.
DATABASE_URL = envstr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/millm")
try:
    _database = dj_database_url.parse(DATABASE_URL, conn_health_checks=True)  # pooled ones are checked when lent
except ValueError as error:
    raise ImproperlyConfigured(f"DATABASE_URL is not a database URL: {error}") from None
if _database["ENGINE"] != "django.db.backends.postgresql":
    raise ImproperlyConfigured(f"DATABASE_URL must be a PostgreSQL URL, got {DATABASE_URL!r}")
# A connection pool (psycopg_pool): under ASGI every request runs its sync code on a thread of
# its own, so persistent per-thread connections would mean a new PostgreSQL backend per request
# (about 6 ms on GET /v1/models/{id}, bench/FINDINGS.md). Django checks a pooled connection
# before lending it, so a PostgreSQL restart costs a reconnect, not a failed request.
_database.setdefault("OPTIONS", {})["pool"] = {
    "min_size": envint("DATABASE_POOL_MIN", 1, minimum=0),
    "max_size": envint("DATABASE_POOL_MAX", 10, minimum=1),
    "timeout": 10,
}
DATABASES = {"default": _database}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = envstr("REDIS_URL", "redis://127.0.0.1:6379/0")
CHANNEL_PREFIX = envstr("MILLM_CHANNEL_PREFIX", "millm")
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [REDIS_URL],
            "prefix": CHANNEL_PREFIX,
            # A streamed answer sends one message per token; the default of 100 is too few.
            "capacity": 10_000,
            "expiry": 60,
        },
    },
}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "var" / "static"

# --- miServer (SPEC section 11) ---
MILLM_DATA_DIR = Path(envstr("MILLM_DATA_DIR", str(BASE_DIR / "var"))).resolve()
MILLM_MODEL = envstr("MILLM_MODEL")  # None: the packaged SmolLM2 GGUF
MILLM_MODEL_ID = envstr("MILLM_MODEL_ID")
# The engine's model chats with this template over its own: a well-known name (chatml, gemma,
# llama3, mistral, phi3) or a Jinja file's path (inference_app/chat_templates.py).
MILLM_CHAT_TEMPLATE = envstr("MILLM_CHAT_TEMPLATE")
MILLM_DEVICE = envstr("MILLM_DEVICE", "auto")
MILLM_DTYPE = envchoice("MILLM_DTYPE", "auto", ["auto", "float32", "bfloat16", "float16"])
# What a GGUF's Q4_0/Q4_1/Q8_0 projections run from (SPEC 7a, inference_app/engine/quantized.py).
MILLM_WEIGHTS = envchoice("MILLM_WEIGHTS", "auto", ["auto", "dense", "quantized", "blocks"])
# Where `auto` keeps the widths it timed at a load, for the next load on this machine
# (inference_app/engine/timed_widths.py): empty, beside the model's conversion cache; a folder, in
# it (the tests keep theirs apart: timed while the suite loads both cores, they are not what a
# server should read).
MILLM_TIMINGS_DIR = envstr("MILLM_TIMINGS_DIR")
# `decode`: the scheduler's decode steps run through torch.compile, compiled at load
# (inference_app/engine/compiled.py); `off` runs every forward pass eagerly.
MILLM_COMPILE = envchoice("MILLM_COMPILE", "off", ["off", "decode"])
# Shared prefixes' keys and values held for reuse (inference_app/engine/prefix_cache.py), per
# engine, least recently used dropped first; 0 turns reuse off everywhere.
MILLM_PREFIX_CACHE_MB = envint("MILLM_PREFIX_CACHE_MB", 256, minimum=0)
# Interactive generation (seated) prefills from the longest cached prefix of its prompt. Not bit
# for bit a lone prefill, so opt-in, as a batch's `prefix_reuse` is.
MILLM_PREFIX_REUSE = envbool("MILLM_PREFIX_REUSE", False)
MILLM_STORAGE = envchoice("MILLM_STORAGE", "filesystem", ["filesystem", "s3"])
MILLM_API_KEYS = envlist("MILLM_API_KEYS")
# Browser origins other than the site's own that may open the WebSocket and Socket.IO
# (e.g. "https://dashboard.example.com"); the site's own origin always may.
MILLM_ALLOWED_ORIGINS = envlist("MILLM_ALLOWED_ORIGINS")
# Each project's quotas unless the admin sets its own (SPEC 10d); unset: no limit.
MILLM_QUOTA_ACTIVE_BATCHES = envint("MILLM_QUOTA_ACTIVE_BATCHES", None, minimum=0)
MILLM_QUOTA_QUEUED_ROWS = envint("MILLM_QUOTA_QUEUED_ROWS", None, minimum=0)
MILLM_QUOTA_FILE_BYTES = envint("MILLM_QUOTA_FILE_BYTES", None, minimum=0)
MILLM_MAX_BODY_BYTES = envint("MILLM_MAX_BODY_BYTES", 33_554_432, minimum=1024)
# A PUT /api/models/{id}/weights body (safetensors): streamed to storage, never held in web's memory.
MILLM_MAX_WEIGHTS_BYTES = envint("MILLM_MAX_WEIGHTS_BYTES", 4 * 1024**3, minimum=1024)
MILLM_REQUEST_TIMEOUT_S = envfloat("MILLM_REQUEST_TIMEOUT_S", 600.0, minimum=0.1)
MILLM_STRICT_DEFAULT = envbool("MILLM_STRICT_DEFAULT", False)

ENGINE_HEARTBEAT_S = envfloat("ENGINE_HEARTBEAT_S", 2.0, minimum=0.1)
ENGINE_STALE_S = envfloat("ENGINE_STALE_S", 10.0, minimum=0.5)
if ENGINE_STALE_S <= ENGINE_HEARTBEAT_S:
    raise ImproperlyConfigured(
        f"ENGINE_STALE_S ({ENGINE_STALE_S}) must be greater than ENGINE_HEARTBEAT_S ({ENGINE_HEARTBEAT_S})"
    )

# SPEC 8's slot count, kept so a deployment that sets it still starts; no longer used: whole-model
# requests run one at a time and generation takes ENGINE_MAX_SEQUENCES seats (SPEC 8a).
MAX_CONCURRENT_REQUESTS = envint("MAX_CONCURRENT_REQUESTS", 1, minimum=1, maximum=64)
MAX_PENDING_REQUESTS = envint("MAX_PENDING_REQUESTS", 10, minimum=1)
# Generation sequences decoding together (SPEC 8a); 1 is the seed's one-at-a-time engine. On a GPU
# the KV cache, not compute, bounds it: 32-64 for a 7B model on 80 GB.
ENGINE_MAX_SEQUENCES = envint("ENGINE_MAX_SEQUENCES", 16, minimum=1, maximum=1024)
# Engines of one model active at once (SPEC 10c), one advisory-lock seat each; 1 is one active
# engine per model and standbys, as before replicas.
ENGINE_MAX_REPLICAS = envint("ENGINE_MAX_REPLICAS", 1, minimum=1, maximum=64)
# Prompt tokens prefilled per step boundary (at least one sequence joins whatever its length):
# a long prompt joining does not stall every live sequence for several prompts' prefills.
ENGINE_PREFILL_TOKENS_PER_STEP = envint("ENGINE_PREFILL_TOKENS_PER_STEP", 2048, minimum=1)
# Prompts that join at one step boundary share one padded prefill ("on") or each runs alone
# ("off"); "auto": together except in float32, whose batched rows equal the rows run alone.
ENGINE_PREFILL_TOGETHER = envchoice("ENGINE_PREFILL_TOGETHER", "auto", ["auto", "on", "off"])
# A 16-bit model's decode steps on a CPU attend on float32 copies ("float32") or in the model's
# dtype ("model"); "auto": whichever the load times clearly faster on this CPU, float32 at a tie.
ENGINE_DECODE_ATTENTION = envchoice("ENGINE_DECODE_ATTENTION", "auto", ["auto", "float32", "model"])
# While a chat decodes, batch rows "pause" (a chat's step runs the chats alone: on a CPU a step of
# 16 rows costs several single steps) or "decode" in the same steps (a GPU's wider step costs
# little more); "auto": pause on a CPU, decode on a GPU.
ENGINE_BATCH_ROWS_BESIDE_CHATS = envchoice("ENGINE_BATCH_ROWS_BESIDE_CHATS", "auto", ["auto", "decode", "pause"])
EMBEDDINGS_MAX_INPUTS = envint("EMBEDDINGS_MAX_INPUTS", 128, minimum=1)
PROBE_SCORE_MAX_INPUTS = envint("PROBE_SCORE_MAX_INPUTS", 64, minimum=1)
PROBE_SCORE_MAX_PROBES = envint("PROBE_SCORE_MAX_PROBES", 8, minimum=1)

BATCH_MAX_ROWS = envint("BATCH_MAX_ROWS", 50_000, minimum=1)
BATCH_MAX_FILE_BYTES = envint("BATCH_MAX_FILE_BYTES", 209_715_200, minimum=1)
BATCH_MAX_LINE_BYTES = envint("BATCH_MAX_LINE_BYTES", 1_048_576, minimum=1)
BATCH_MAX_COMPLETION_WINDOW_HOURS = envint("BATCH_MAX_COMPLETION_WINDOW_HOURS", 168, minimum=1)
BATCH_CHUNK_ROWS = envint("BATCH_CHUNK_ROWS", 8, minimum=1)
BATCH_PACK_MAX_ROWS = envint("BATCH_PACK_MAX_ROWS", 16, minimum=1)
BATCH_PACK_MAX_TOKENS = envint("BATCH_PACK_MAX_TOKENS", 16_384, minimum=1)
BATCH_PACK_DEFAULT = envbool("BATCH_PACK_DEFAULT", False)
BATCH_DECODING_DEFAULT = envbool("BATCH_DECODING_DEFAULT", False)
BATCH_PACK_WINDOW_DEFAULT = envint("BATCH_PACK_WINDOW_DEFAULT", 0, minimum=0)
BATCH_PACK_WINDOW_MAX = envint("BATCH_PACK_WINDOW_MAX", 1024, minimum=0)
BATCH_LEASE_TTL_S = envint("BATCH_LEASE_TTL_S", 900, minimum=3)
BATCH_PROGRESS_MIN_INTERVAL_S = envfloat("BATCH_PROGRESS_MIN_INTERVAL_S", 1.0, minimum=0)
BATCH_FILE_RETENTION_DAYS = envint("BATCH_FILE_RETENTION_DAYS", 30, minimum=1)
BATCH_RETENTION_INTERVAL_S = envint("BATCH_RETENTION_INTERVAL_S", 3600, minimum=1)
# Ended batches and their rows are deleted this long after they end (default: the files' retention).
BATCH_RETENTION_DAYS = envint("BATCH_RETENTION_DAYS", BATCH_FILE_RETENTION_DAYS, minimum=1)
# Stored responses (POST /v1/responses with store) are deleted this long after they were made.
RESPONSES_RETENTION_DAYS = envint("RESPONSES_RETENTION_DAYS", 30, minimum=1)
BATCH_WAIT_POLL_S = envfloat("BATCH_WAIT_POLL_S", 5.0, minimum=0.05)
# Tests only: pause between a chunk's forward pass and its record, so a test can kill the
# engine mid-chunk.
BATCH_TEST_PAUSE_BEFORE_RECORD_S = envfloat("BATCH_TEST_PAUSE_BEFORE_RECORD_S", 0.0, minimum=0)

# Webhooks (SPEC 10b): the hosts endpoints may name (empty: any), how long and how often a
# delivery is retried, and how long one attempt may take.
MILLM_WEBHOOK_ALLOWED_HOSTS = envlist("MILLM_WEBHOOK_ALLOWED_HOSTS")
MILLM_WEBHOOK_RETRY_HOURS = envfloat("MILLM_WEBHOOK_RETRY_HOURS", 72.0, minimum=0.0001)
MILLM_WEBHOOK_TIMEOUT_S = envfloat("MILLM_WEBHOOK_TIMEOUT_S", 10.0, minimum=0.1)
MILLM_WEBHOOK_BACKOFF_S = envfloat("MILLM_WEBHOOK_BACKOFF_S", 2.0, minimum=0.01)
MILLM_WEBHOOK_BACKOFF_MAX_S = envfloat("MILLM_WEBHOOK_BACKOFF_MAX_S", 3600.0, minimum=0.01)
MILLM_WEBHOOK_POLL_S = envfloat("MILLM_WEBHOOK_POLL_S", 1.0, minimum=0.05)
WEBHOOK_TEST_PAUSE_BEFORE_SEND_S = envfloat("WEBHOOK_TEST_PAUSE_BEFORE_SEND_S", 0.0, minimum=0)

# Bodies other than uploads: Django refuses a larger one with RequestDataTooBig (413 here).
DATA_UPLOAD_MAX_MEMORY_SIZE = MILLM_MAX_BODY_BYTES

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["millm_lib.drf.JSONParser"],
    "EXCEPTION_HANDLER": "millm_lib.drf.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

# The OpenAPI schema at /api/schema/: drf-spectacular documents the DRF viewsets (files,
# batches); millm_lib.openapi.add_plain_views documents every other route from the URL resolver.
SPECTACULAR_SETTINGS = {
    "TITLE": "miServer",
    "DESCRIPTION": "An OpenAI-compatible inference server for one resident model, with a durable Batch API.",
    "VERSION": VERSION,
    "OAS_VERSION": "3.1.0",
    "SERVE_INCLUDE_SCHEMA": True,
    "POSTPROCESSING_HOOKS": ["millm_lib.openapi.add_plain_views"],
}

# File bytes: a folder under MILLM_DATA_DIR, or an S3 bucket with django-storages' AWS_* settings.
if MILLM_STORAGE == "s3":
    try:
        from boto3.s3.transfer import TransferConfig
    except ImportError:
        raise ImproperlyConfigured("MILLM_STORAGE=s3 needs boto3: pip install -e '.[s3]'") from None
    # boto3 keeps up to 10 parts of 8 MB of an upload in memory and fetches a download over 10
    # connections; two at a time keeps a 100 MB upload or download within tens of MB of web's memory.
    _transfer = TransferConfig(max_concurrency=2)
    _transfer.max_in_memory_upload_chunks = 2
    _storage = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": envstr("AWS_STORAGE_BUCKET_NAME"),
            "endpoint_url": envstr("AWS_S3_ENDPOINT_URL"),
            "region_name": envstr("AWS_S3_REGION_NAME"),
            "location": envstr("AWS_LOCATION", "millm"),
            # A download (GET .../content, a batch's input) spools to a temporary file past this;
            # django-storages' default, 0, holds the whole object in memory.
            "max_memory_size": 2_621_440,
            "transfer_config": _transfer,
        },
    }
    if not _storage["OPTIONS"]["bucket_name"]:
        raise ImproperlyConfigured("MILLM_STORAGE=s3 needs AWS_STORAGE_BUCKET_NAME")
else:
    _storage = {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(MILLM_DATA_DIR)}}
STORAGES = {
    "default": _storage,
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
# Uploads stream to disk chunk by chunk; nothing over this stays in memory.
FILE_UPLOAD_TEMP_DIR = str(MILLM_DATA_DIR / "tmp")
FILE_UPLOAD_MAX_MEMORY_SIZE = 2_621_440
FILE_UPLOAD_PERMISSIONS = 0o640

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": envstr("MILLM_LOG_LEVEL", "INFO")},
    "loggers": {
        "httpx": {"level": "WARNING"},
        # A line per batch chunk executed (batch, engine, lines): an audit trail that a recorded
        # row never ran again; the end-to-end tests count executions with it.
        "millm.batches.executions": {"level": "INFO" if envbool("MILLM_LOG_EXECUTIONS", False) else "WARNING"},
    },
}
