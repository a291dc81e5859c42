"""Lease checks shared by web (load, unload, lease routes) and the engine (auto-load, swaps)."""

import re

from millm_lib.errors import ApiError
from inference_app.models import Lease

LEASE_HEADER = "X-miLLM-Lease"
_LEASE_ID = re.compile(r"^lease_[0-9a-f]{40}$")


def presented_lease(value):
    """The lease an X-miLLM-Lease header names, or None when absent.

    Malformed: 400 invalid_lease_request. Unknown: 404 lease_not_found.
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
    lease = Lease.objects.find(value.strip())
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


def check_lease_allows(model_id, header_value, action):
    """Raise unless `model_id` has no live lease or the caller presents that very lease."""
    presented = presented_lease(header_value)
    if presented is not None and not presented.live:
        raise lease_expired(presented)
    if model_id is None:
        return presented
    live = Lease.objects.on_model(model_id)
    if live is None or (presented is not None and presented.pk == live.pk):
        return presented
    raise model_leased(live, action)
