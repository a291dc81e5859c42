"""OpenAI's list shape and query parameters, shared by the Files and Batch APIs."""

from django.db.models import Q

from millm_lib.errors import ApiError


def cursor_page(queryset, after=None, limit=20, order="desc"):
    """One page of a list ordered by (created_at, id), after the object `after` names;
    returns (items, has_more)."""
    descending = order == "desc"
    queryset = queryset.order_by(*(["-created_at", "-id"] if descending else ["created_at", "id"]))
    if after:
        anchor = queryset.model.objects.filter(pk=after).values("created_at", "id").first()
        if anchor is not None:
            older = "lt" if descending else "gt"
            queryset = queryset.filter(
                Q(**{f"created_at__{older}": anchor["created_at"]})
                | Q(created_at=anchor["created_at"], **{f"id__{older}": anchor["id"]})
            )
    items = list(queryset[: limit + 1])
    return items[:limit], len(items) > limit


def list_page(shape, data, has_more):
    """One page as OpenAI lists it, built by the list's own shape (FileList, BatchList)."""
    return shape(
        object="list",
        data=data,
        first_id=data[0]["id"] if data else None,
        last_id=data[-1]["id"] if data else None,
        has_more=has_more,
    )


def _query(request):
    """A DRF request's query_params, or a plain Django request's GET."""
    return getattr(request, "query_params", None) or request.GET


def query_int(request, name, default, low, high):
    raw = _query(request).get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ApiError(400, "invalid_parameter", f"Invalid value for '{name}': a whole number from {low} to {high}, got {raw!r}", param=name)
    return value


def query_choice(request, name, default, choices):
    raw = _query(request).get(name) or default
    if raw not in choices:
        raise ApiError(400, "invalid_parameter", f"Invalid value for '{name}': one of {', '.join(choices)}, got {raw!r}", param=name)
    return raw
