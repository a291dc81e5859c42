"""Cross-cutting HTTP behaviour: request ids, bearer keys, the error envelopes, metrics, and a
body-size guard that refuses a declared oversize body before it is read."""

import json
import logging
import re
import time

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string

from millm_lib import metrics
from millm_lib.db import on_db_pool
from millm_lib.errors import (
    ApiError,
    error_response,
    is_management,
    is_v1,
    internal_error,
    method_not_allowed,
    not_found_route,
    request_too_large,
)
from millm_lib.ids import new_id
from millm_lib.keys import bearer_token
from files_app.uploads import MULTIPART_ALLOWANCE, file_limit
from projects_app.access import project_for_key

log = logging.getLogger("millm.web")

_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
_UPLOAD_PATHS = ("/v1/files",)


def needs_key(path):
    return is_v1(path) or is_management(path) or path == "/metrics"


def render_error(path, error, request_id=None):
    response = error_response(error, management=is_management(path))
    return finish_headers(response, request_id)


def finish_headers(response, request_id):
    if request_id:
        response["X-Request-ID"] = request_id
    response.setdefault("X-Content-Type-Options", "nosniff")  # what SecurityMiddleware sets, for every route
    # Deterministic refusals: the SDK must not resend them. A 429 without Retry-After (a
    # project's quota) frees only when a batch ends or a file goes: no retry soon helps.
    status = response.status_code
    if 400 <= status < 500 and (status not in (408, 429) or (status == 429 and not response.has_header("Retry-After"))):
        response["x-should-retry"] = "false"
    return response


class Middleware:
    """Base for middleware that works under both WSGI and ASGI without a thread hop."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        early = self.before(request)
        if early is not None:
            return self.after(request, early)
        return self.after(request, self.get_response(request))

    async def _acall(self, request):
        early = self.before(request)
        if early is not None:
            return self.after(request, early)
        return self.after(request, await self.get_response(request))

    def before(self, request):
        return None

    def after(self, request, response):
        return response


ADMIN_MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]


def is_admin(path):
    return path == "/admin" or path.startswith("/admin/")


class AdminMiddleware:
    """Django's session, common, auth and message middleware, for the admin only.

    Under ASGI each of them runs its hooks in a thread (they are sync MiddlewareMixin classes):
    a dozen thread hops on every API call (about 0.5 ms on /api/health, bench/FINDINGS.md). The API
    routes use none of them (bearer keys: no session, no cookie), so only /admin/ goes through
    them, in their usual order. Security, CSRF and clickjacking are in MIDDLEWARE itself, for every
    route (the deploy checks look for them there; the API's views are CSRF-exempt).
    """

    sync_capable = False
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        markcoroutinefunction(self)
        handler, chain = get_response, []
        for path in reversed(ADMIN_MIDDLEWARE):
            handler = import_string(path)(handler)
            chain.insert(0, handler)
        self.admin = handler
        self.view_hooks = [sync_to_async(m.process_view) for m in chain if hasattr(m, "process_view")]

    async def __call__(self, request):
        if is_admin(request.path):
            return await self.admin(request)
        return await self.get_response(request)

    async def process_view(self, request, view, args, kwargs):
        if not is_admin(request.path):
            return None
        for hook in self.view_hooks:
            response = await hook(request, view, args, kwargs)
            if response is not None:
                return response
        return None


class RequestIdMiddleware(Middleware):
    """X-Request-ID on every response (the caller's if sane), x-should-retry, and metrics."""

    def before(self, request):
        sent = request.headers.get("X-Request-ID", "")
        request.request_id = sent if _REQUEST_ID.match(sent) else new_id("req_")
        request.millm_started = time.monotonic()

    def after(self, request, response):
        route = metrics.route_label(request)
        metrics.requests_total.labels(route, request.method, str(response.status_code)).inc()
        metrics.request_seconds.labels(route).observe(time.monotonic() - request.millm_started)
        return finish_headers(response, request.request_id)


class ApiErrorMiddleware(Middleware):
    """Every /v1 and /api error in its envelope (SPEC 2), framework errors included."""

    def after(self, request, response):
        path = request.path
        if response.status_code < 400 or getattr(response, "millm_envelope", False):
            return response
        if not (is_v1(path) or is_management(path)):
            return response
        if response.status_code == 404:
            error = not_found_route(request.method, path)
        elif response.status_code == 405:
            allowed = [method.strip() for method in response.get("Allow", "").split(",") if method.strip()]
            error = method_not_allowed(request.method, path, allowed)
            wrapped = error_response(error, management=is_management(path))
            wrapped["Allow"] = response.get("Allow", "")
            return wrapped
        elif response.status_code == 403:
            error = ApiError(403, "forbidden", _reason(response) or "Forbidden")
        elif response.status_code >= 500:
            error = internal_error()
        else:
            error = ApiError(response.status_code, "invalid_request", _reason(response) or "Bad request")
        return error_response(error, management=is_management(path))

    def process_exception(self, request, exception):
        path = request.path
        if not (is_v1(path) or is_management(path)):
            return None
        if isinstance(exception, ApiError):
            error = exception
        elif isinstance(exception, RequestDataTooBig):
            declared = request.META.get("CONTENT_LENGTH")
            measured = f"{int(declared):,} bytes" if declared and declared.isdigit() else "over the limit"
            error = request_too_large(measured, settings.MILLM_MAX_BODY_BYTES)
        elif (error := backend_unavailable(exception)) is not None:
            log.warning("%s on %s %s: %s", error.code, request.method, path, exception)
        else:
            log.exception("unhandled error on %s %s", request.method, path, exc_info=exception)
            error = internal_error()
        return error_response(error, management=is_management(path))


BACKEND_RETRY_AFTER_S = 2


def backend_unavailable(exception):
    """PostgreSQL or Redis unreachable (restarting, a network cut): 503 with Retry-After, which a
    client retries, rather than a 500; both come back by themselves. Else None."""
    from django.db import InterfaceError, OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exception, (OperationalError, InterfaceError)):
        what = "the database (PostgreSQL)"
    elif isinstance(exception, (RedisConnectionError, RedisTimeoutError)):
        what = "the channel layer (Redis) that carries requests to the engine"
    else:
        return None
    return ApiError(503, "service_unavailable", f"The server cannot reach {what} right now; retry shortly",
                    retry_after=BACKEND_RETRY_AFTER_S)


def _reason(response):
    try:
        return response.content.decode("utf-8", "replace").strip()[:200]
    except Exception:
        return ""


class ApiKeyMiddleware(Middleware):
    """Who the caller is (SPEC 10d): `request.project`, from its bearer key. Once keys exist
    (MILLM_API_KEYS, or keys made by `createapikey` or the admin) every route but health and the
    admin needs an active one; until then every caller is the default project. The key is looked
    up on every request, so a revoked key is refused from the next one."""

    def before(self, request):
        if not needs_key(request.path):
            request.project = None
            return None
        token = bearer_token(request.headers.get("Authorization", ""))
        request.project = project_for_key(token)
        if request.project is not None:
            return None
        reason = "wrong or revoked" if token else "missing"
        return render_error(
            request.path,
            ApiError(401, "invalid_api_key",
                     f"The bearer key is {reason}: send Authorization: Bearer <key> with a key from MILLM_API_KEYS "
                     "or one `manage.py createapikey` made"),
            request.request_id,
        )

    async def _acall(self, request):
        # The key is looked up in the database: off the event loop, on the gateway's few shared
        # threads. On the request's own thread each waiting chat would hold a connection from the
        # pool until it ends: 100 queued chats would exhaust it and fail with 500.
        early = await on_db_pool(self.before)(request)
        if early is not None:
            return self.after(request, early)
        return self.after(request, await self.get_response(request))


class UrlGuardMiddleware(Middleware):
    """A NUL (%00) in the path or a query parameter is a 400 naming where it is: no id or value
    here can hold one (PostgreSQL cannot store U+0000), so it never reaches a query."""

    def before(self, request):
        if "\x00" in request.path:
            where = "path"
        else:
            where = next((name for name, values in request.GET.lists()
                          if "\x00" in name or any("\x00" in value for value in values)), None)
        if where is None:
            return None
        where = where.replace("\x00", "%00")
        return render_error(
            request.path,
            ApiError(400, "invalid_parameter", f"Invalid value for '{where}': it holds a NUL character (%00), "
                     "which no id or value here can hold", param=where),
            request.request_id,
        )


class BodyLimitASGI:
    """Refuse an oversize body at the ASGI edge: a declared Content-Length before reading,
    an undeclared (chunked) one the moment the bytes received cross the limit.

    Uploads have their own limit (BATCH_MAX_FILE_BYTES, plus room for the multipart framing);
    every other body has MILLM_MAX_BODY_BYTES.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, refusal = _body_limit(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await self._refuse(scope, send, refusal(f"{declared:,} bytes declared"))
            return
        received = 0
        over = False

        async def counting_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    # Django stops reading at a disconnect and answers nothing; we answer.
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, counting_receive, send)
        if over:
            await self._refuse(scope, send, refusal(f"at least {received:,} bytes"))

    async def _refuse(self, scope, send, error):
        management = is_management(scope["path"])
        body = json.dumps(error.management_body() if management else error.body()).encode()
        sent_id = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-request-id", (sent_id if _REQUEST_ID.match(sent_id) else new_id("req_")).encode()),
            (b"x-should-retry", b"false"),
            (b"connection", b"close"),
        ]
        # Answered here, not by Django: counted as every other answer is (RequestIdMiddleware),
        # before the send, which fails when the client has gone.
        metrics.requests_total.labels(_route_of(scope["path"]), scope["method"], str(error.status)).inc()
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _route_of(path):
    try:
        return resolve(path).route
    except Resolver404:
        return "unmatched"


def _body_limit(path):
    if path.rstrip("/") in _UPLOAD_PATHS:
        limit = settings.BATCH_MAX_FILE_BYTES
        return limit + MULTIPART_ALLOWANCE, lambda measured: file_limit(
            "size", limit, "BATCH_MAX_FILE_BYTES", f"the request body is {measured}"
        )
    if path.startswith("/api/models/") and path.rstrip("/").endswith("/weights"):
        limit = settings.MILLM_MAX_WEIGHTS_BYTES
        return limit, lambda measured: request_too_large(measured, limit, "MILLM_MAX_WEIGHTS_BYTES")
    limit = settings.MILLM_MAX_BODY_BYTES
    return limit, lambda measured: request_too_large(measured, limit)


def _content_length(scope):
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
