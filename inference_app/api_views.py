"""Management routes under /api: the model catalogue and lifecycle, leases, probes.

Answers are `{"success": true, "data": ..., "error": null}`; refusals raise ApiError, which the
middleware renders in the management envelope.
"""

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from inference_app import chat_templates, gateway, weight_uploads
from inference_app.catalogue import model_not_loaded, model_source
from millm_lib.errors import ApiError, json_response, require_json
from inference_app.leases import LEASE_HEADER, lease_expired, lease_not_found, model_leased, presented_lease
from inference_app.models import Engine, Lease, ModelEntry, Probe
from inference_app.schemas import (
    LeaseRequest,
    LoadRequest,
    ModelRegistration,
    ProbeImport,
    ProbeScoreRequest,
    parse_management,
    parse_request,
)
from millm_lib.jsonbody import decode_json
from millm_lib.limits import PROBE_SCORE
from millm_lib.openapi import Op, documented
from millm_lib.openapi import data as success
from millm_lib.shapes import ManagementSuccess
from inference_app.shapes import (
    CatalogueEntry,
    ControlAccepted,
    LeaseAcquired,
    LeaseReleased,
    LeaseStatus,
    ProbeDeleted,
    ProbeDetail,
    ProbeScores,
    ProbeSummary,
    SavedCheckpoint,
    WeightsState,
)
from inference_app.headers import LEASE_HEADER_DOC

LEASED = (LEASE_HEADER_DOC,)


def ok(data, status=200, headers=None):
    return json_response(ManagementSuccess(success=True, data=data, error=None), status=status, headers=headers)


def api_route(*methods):
    def decorate(view):
        return csrf_exempt(require_http_methods(list(methods))(view))

    return decorate


def management_op(summary, responses, **documentation):
    """An operation of a management route: its errors take the management envelope."""
    return Op(summary, responses, envelope="management", **documentation)


def _body(request, schema, code):
    raw = request.body
    if not raw.strip():
        return parse_management(schema, {}, code)
    require_json(request)
    return parse_management(schema, decode_json(raw), code)


def _entry(model_id):
    entry = ModelEntry.objects.filter(pk=model_id).first()
    if entry is None:
        raise ApiError(404, "model_not_found", f"The model '{model_id}' is not in the catalogue", param="model")
    return entry


# --- the catalogue and lifecycle ---


@documented(
    GET=management_op("The catalogue", {200: success({"type": "array", "items": CatalogueEntry})}),
    POST=management_op("Register a model on the server's disk", {201: success(CatalogueEntry)}, request=ModelRegistration),
)
@api_route("GET", "POST")
def models(request):
    if request.method == "GET":
        return ok([entry.to_management() for entry in ModelEntry.objects.order_by("-created_at", "-id")])
    body = _body(request, ModelRegistration, "invalid_model_request")
    try:
        source = model_source(body.source, body.id, body.chat_template)
    except ImproperlyConfigured as error:
        message = str(error).replace("MILLM_MODEL", "source")
        raise ApiError(400, "invalid_model_request", message, param="source", details={"field": "source"}) from None
    except OSError as error:  # a name too long for the filesystem, a loop of links...
        raise ApiError(400, "invalid_model_request", f"source cannot be read: {error.strerror} "
                       f"({len(body.source):,} characters)", param="source", details={"field": "source"}) from None
    if body.chat_template is not None:
        try:
            chat_templates.check_setting(body.chat_template, field="chat_template")
        except ImproperlyConfigured as error:
            raise ApiError(400, "invalid_model_request", str(error), param="chat_template",
                           details={"field": "chat_template"}) from None
    try:
        entry = ModelEntry.objects.register(source)
    except IntegrityError:
        raise ApiError(
            409, "model_exists", f"The catalogue already has a model '{source.model_id}'; send another id",
            details={"field": "id"},
        ) from None
    return ok(entry.to_management(), status=201)


@documented(GET=management_op("A catalogue entry", {200: success(CatalogueEntry)}))
@api_route("GET")
def model(request, model_id):
    return ok(_entry(model_id).to_management())


@documented(POST=management_op("Make the model resident (in the background)", {202: success(ControlAccepted)},
                               request=LoadRequest, request_required=False, headers=LEASED))
@api_route("POST")
async def model_load(request, model_id):
    body = await sync_to_async(_body)(request, LoadRequest, "invalid_load_request")
    entry = await sync_to_async(_entry)(model_id)
    engine = await sync_to_async(gateway.engine_to_load)(entry.pk, body.engine)
    acknowledged = await gateway.control(
        engine, "load", request.request_id, model_id=entry.pk, lease=request.headers.get(LEASE_HEADER),
        project=gateway.caller(request),
    )
    entry = await sync_to_async(_entry)(model_id)
    return ok(ControlAccepted(model=entry.to_management(), engine=acknowledged["engine"]), status=202)


@documented(POST=management_op("Unload the resident model (in the background)", {202: success(ControlAccepted)},
                               headers=LEASED))
@api_route("POST")
async def model_unload(request, model_id):
    entry = await sync_to_async(_entry)(model_id)
    engine = await sync_to_async(Engine.objects.serving)(entry.pk)
    if engine is None:
        raise ApiError(409, "model_not_resident", f"The model '{model_id}' is not resident; nothing to unload")
    acknowledged = await gateway.control(engine, "unload", request.request_id, lease=request.headers.get(LEASE_HEADER),
                                         project=gateway.caller(request))
    entry = await sync_to_async(_entry)(model_id)
    return ok(ControlAccepted(model=entry.to_management(), engine=acknowledged["engine"]), status=202)


# --- weights: edits and checkpoints (SPEC 5, "Weights") ---


@documented(POST=management_op("Begin a weights edit (weights torn)", {200: success(WeightsState)}, headers=LEASED))
@api_route("POST")
async def weights_begin(request, model_id):
    return await _weights(request, model_id, "begin")


@documented(PUT=management_op("Overwrite named tensors (a safetensors body)", {200: success(WeightsState)},
                              request={"application/octet-stream": {"type": "string", "format": "binary"}},
                              headers=LEASED))
@api_route("PUT")
async def weights_write(request, model_id):
    """A safetensors body of named tensors: streamed to storage for the engine, never held here."""
    upload = await sync_to_async(weight_uploads.save)(request)
    try:
        return await _weights(request, model_id, "write", upload=upload)
    finally:
        await sync_to_async(weight_uploads.discard)(upload)


@documented(POST=management_op("Commit a weights edit (weights clean)", {200: success(WeightsState)}, headers=LEASED))
@api_route("POST")
async def weights_commit(request, model_id):
    return await _weights(request, model_id, "commit")


@documented(POST=management_op("Save the resident weights as a checkpoint", {201: success(SavedCheckpoint)},
                               headers=LEASED))
@api_route("POST")
async def model_save(request, model_id):
    return await _weights(request, model_id, "save")


async def _weights(request, model_id, op, **fields):
    entry = await sync_to_async(_entry)(model_id)
    engine = await sync_to_async(Engine.objects.serving)(entry.pk)
    if engine is None:
        raise ApiError(
            409, "model_not_resident",
            f"The model '{model_id}' is not resident: only the resident model's weights are edited or saved",
            param="model",
        )
    data = await gateway.control(
        engine, "weights", request.request_id, op=op, model_id=entry.pk, lease=request.headers.get(LEASE_HEADER),
        project=gateway.caller(request), **fields
    )
    return ok(data, status=201 if op == "save" else 200)


# --- leases ---


@documented(
    GET=management_op("The lease's status (never its id), or null",
                      {200: success({"anyOf": [LeaseStatus, {"type": "null"}]})}),
    POST=management_op("Acquire the lease (its id is shown once)", {201: success(LeaseAcquired)}, request=LeaseRequest),
    DELETE=management_op("Release the lease named by X-miLLM-Lease", {200: success(LeaseReleased)}, headers=LEASED),
)
@api_route("GET", "POST", "DELETE")
def lease(request, model_id):
    entry = _entry(model_id)
    if request.method == "GET":
        live = Lease.objects.on_model(entry.pk)
        return ok(live.status() if live else None)
    if request.method == "DELETE":
        held = _presented_for(request, entry)
        held.release()
        return ok(LeaseReleased(released=True, **held.status()))
    body = _body(request, LeaseRequest, "invalid_lease_request")
    engine = Engine.objects.serving(entry.pk)
    if engine is None:
        raise ApiError(409, "model_not_resident", f"The model '{model_id}' is not resident; only a resident model is leased")
    held, lease_id = Lease.acquire(engine, entry.pk, body.holder, body.reason, body.ttl_seconds, project=request.project)
    if lease_id is None:
        raise model_leased(held, "a second lease")
    return ok(LeaseAcquired(id=lease_id, **held.status()), status=201)


@documented(POST=management_op("Renew the lease named by X-miLLM-Lease", {200: success(LeaseStatus)}, headers=LEASED))
@api_route("POST")
def lease_renew(request, model_id):
    held = _presented_for(request, _entry(model_id))
    if not held.renew():
        raise lease_expired(held)
    return ok(held.status())


def _presented_for(request, entry):
    value = request.headers.get(LEASE_HEADER)
    if not value:
        raise ApiError(400, "invalid_lease_request", f"Send the lease id in {LEASE_HEADER}", param=LEASE_HEADER)
    held = presented_lease(value, request.project)
    if held.model_id != entry.pk:
        raise lease_not_found()
    if not held.live:
        raise lease_expired(held)
    return held


# --- probes ---


@documented(
    GET=management_op("The probes", {200: success({"type": "array", "items": ProbeSummary})}),
    POST=management_op("Import a probe, checked against the resident model", {201: success(ProbeSummary)},
                       request=ProbeImport),
)
@api_route("GET", "POST")
def probes(request):
    if request.method == "GET":
        return ok([probe.summary() for probe in Probe.objects.owned_by(request.project)])
    body = _body(request, ProbeImport, "invalid_probe_request")
    _check_probe_against_resident(body)
    probe = Probe.objects.import_probe(body, project=request.project)
    return ok(probe.summary(), status=201)


def _check_probe_against_resident(body):
    """Every field that does not fit the resident model, named with what it expected (409)."""
    reference = ModelEntry.objects.probe_reference(body.model)
    if reference is None:
        raise model_not_loaded()
    mismatches = reference.probe_mismatches(body)
    if mismatches:
        named = "; ".join(f"{m['field']}: expected {m['expected']}, got {m['actual']}" for m in mismatches)
        raise ApiError(
            409,
            "probe_model_mismatch",
            f"The probe does not fit the resident model '{reference.pk}': {named}",
            details={"mismatches": mismatches},
        )


@documented(
    GET=management_op("A probe", {200: success(ProbeDetail)}),
    DELETE=management_op("Delete a probe", {200: success(ProbeDeleted)}),
)
@api_route("GET", "DELETE")
def probe(request, probe_id):
    found = Probe.objects.owned_by(request.project).filter(pk=probe_id).first()
    if found is None:
        raise ApiError(404, "probe_not_found", f"No probe has the id '{probe_id}'")
    if request.method == "DELETE":
        found.delete()
        return ok(ProbeDeleted(id=probe_id, deleted=True))
    return ok(found.detail())


@documented(POST=management_op("Score inputs with probes on the resident model", {200: success(ProbeScores)},
                               request=ProbeScoreRequest))
@api_route("POST")
async def probe_score(request):
    require_json(request)
    raw = request.body
    parsed = parse_request(PROBE_SCORE, decode_json(raw), strict=True)
    model_id = await sync_to_async(Probe.objects.owned_by(request.project).model_of)(parsed.request.probe_ids)
    engine = await gateway.engine_with_resident_model(model_id)
    body, headers = await gateway.call(engine, PROBE_SCORE, raw.decode("utf-8"), True, request.request_id,
                                       {"project": gateway.caller(request)})
    return json_response(body, headers=headers)

