"""Lease checks shared by web (load, unload, lease routes) and the engine (auto-load, swaps).

A lease belongs to the project that took it (SPEC 10d): a caller presenting another project's
lease is answered as for an unknown one. A live lease still binds every project, its holder named.
"""

import re

from millm_lib.errors import ApiError
from inference_app.models import Lease
from projects_app.models import Project

LEASE_HEADER = "X-miLLM-Lease"
_LEASE_ID = re.compile(r"^lease_[0-9a-f]{40}$")


def presented_lease(value, project=None):
    """The lease an X-miLLM-Lease header names, or None when absent; `project` is the caller's
    (None: the engine's own callers, which may present any lease).

    Malformed: 400 invalid_lease_request. Unknown, or another project's: 404 lease_not_found.
    """
    if value is None or value == "":
        return None
    if not _LEASE_ID.match(value.strip()):
        raise ApiError(
            400,
            "invalid_lease_request",
            f"{LEASE_HEADER} must be a lease id as POST /api/models/{{id}}/lease returned it",
            param=LEASE_HEADER,
        )
    lease = Lease.objects.owned_by(project).find(value.strip())
    if lease is None:
        raise lease_not_found()
    return lease


def lease_not_found():
    return ApiError(404, "lease_not_found", f"No lease has the id sent in {LEASE_HEADER}", param=LEASE_HEADER)


def lease_expired(lease):
    return ApiError(
        409,
        "lease_expired",
        f"The lease sent in {LEASE_HEADER} has ended ({lease.why_ended()}); acquire a new one",
        param=LEASE_HEADER,
    )


def model_leased(lease, action):
    return ApiError(
        409,
        "model_leased",
        f"The model '{lease.model_id}' is leased: {lease.describe()}. It blocks {action}; "
        f"the holder may send its lease in {LEASE_HEADER}",
    )


def check_lease_allows(model_id, header_value, action, project_id=None):
    """For the engine: raise unless `model_id` has no live lease or the caller presents that very
    lease, one of its project's (`project_id`, as web forwarded it; None: the engine's own
    callers). Another project's live lease binds the caller all the same: it is not scoped."""
    presented = presented_lease(header_value, Project.objects.calling(project_id)) if header_value else None
    if presented is not None and not presented.live:
        raise lease_expired(presented)
    if model_id is None:
        return presented
    live = Lease.objects.on_model(model_id)
    if live is None or (presented is not None and presented.pk == live.pk):
        return presented
    raise model_leased(live, action)
