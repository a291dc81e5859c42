"""With MILLM_API_KEYS set, every route but health refuses a caller without the key (issue 10,
part 7): HTTP routes as Django's URL resolver lists them, the WebSocket routes as the ASGI
router lists them, and Socket.IO. The admin needs a staff login instead. A lease id appears in
the grant's response and nowhere else: not in another response, the admin, the logs or the
database. File content cannot be read outside storage.

The routes are derived from the resolver and the ASGI application, not listed here, so a new
route that does not need the key fails the test; OPEN_ROUTES is the whole allow-list.
"""

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import urllib.parse

import httpx
import pytest
from django.contrib.admin.utils import quote
from django.urls import URLPattern, URLResolver, get_resolver, resolve

from tests.e2e.batch_helpers import FINISHED, line, to_jsonl
from tests.e2e.conftest import MODEL_ID
from tests.e2e.stack import ROOT, Stack, wait_until

KEY = "key-alpha-7f3c"
OTHER_KEY = "key-beta-19d2"
WITH_KEY = {"Authorization": f"Bearer {KEY}"}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]

# The whole allow-list: liveness and the detailed health answer without a key (SPEC 1, 7).
OPEN_ROUTES = {"api/health", "api/health/detailed"}
# The admin has its own door: a staff login (tested below), not the bearer key; its CSS and
# scripts under STATIC_URL are public files, served before Django's resolver.
STAFF_ONLY_PREFIX = "admin/"
# A concrete value for each URL parameter, so that every pattern becomes a path to request.
PLACEHOLDERS = {
    "model_id": "some-org/some-model:Q4_0",
    "probe_id": "probe_placeholder",
    "pk": "placeholder_id",
    "batch_id": "batch_" + "0" * 24,
    "response_id": "resp_" + "0" * 24,
}
STAFF = ("operator", "staff-pass-5521")
NOT_STAFF = ("visitor", "visitor-pass-8812")


@pytest.fixture(scope="module")
def secured(tmp_path_factory, test_model_dir):
    """A stack of its own (leases and users stay here), with a second web process that has keys."""
    with Stack.running(tmp_path_factory.mktemp("security"), test_model_dir, BATCH_WAIT_POLL_S=0.2) as stack:
        stack.keyed = stack.start_web(MILLM_API_KEYS=f"{KEY},{OTHER_KEY}")
        yield stack


# --- the routes, as Django and the ASGI router list them ---


def http_routes(patterns=None, prefix=""):
    """(route text, view) for every URL pattern, resolvers walked recursively."""
    for pattern in get_resolver().url_patterns if patterns is None else patterns:
        if isinstance(pattern, URLResolver):
            yield from http_routes(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            yield prefix + str(pattern.pattern), pattern.callback


def concrete(route):
    """A pattern as a path: `<conv:name>` and `(?P<name>...)` become PLACEHOLDERS[name]."""
    def placeholder(match):
        name = match.group(1)
        assert name in PLACEHOLDERS, f"a route has a new URL parameter {name!r}: give it a placeholder"
        return PLACEHOLDERS[name]

    text = re.sub(r"\(\?P<(\w+)>(?:[^()]|\([^()]*\))*\)", placeholder, route)
    text = re.sub(r"<(?:\w+:)?(\w+)>", placeholder, text)
    return text.replace("^", "").replace("$", "").replace("\\", "")


def websocket_chain(application):
    """The WebSocket side's layers, outermost first: the Socket.IO router, channels' cookie,
    session and auth middleware (a staff session counts as a key), then the URLRouter."""
    layer, chain = application.application_mapping["websocket"], []
    while layer is not None:
        chain.append(layer)
        layer = getattr(layer, "other", None) or getattr(layer, "inner", None)
    return chain


def websocket_routes():
    """Concrete paths of the WebSocket URLRouter behind the ASGI application's Socket.IO router."""
    from millm_site.asgi import application

    router = websocket_chain(application)[-1]
    paths = []
    for route in router.routes:
        regex = str(route.pattern.regex.pattern if hasattr(route.pattern, "regex") else route.pattern)
        path = "/" + concrete(regex)
        assert route.pattern.regex.match(path[1:]), f"the placeholder path {path} does not match {regex}"
        paths.append(path)
    return paths


def socketio_path():
    from millm_site.socketio_app import application

    return application.engineio_path


def keyed_routes():
    """(route, concrete path) of every route that must need the key: all but OPEN_ROUTES and the admin."""
    return [(route, "/" + concrete(route)) for route, _ in http_routes()
            if not route.startswith(STAFF_ONLY_PREFIX) and route.strip("^$") not in OPEN_ROUTES]


def test_the_enumeration_covers_every_route_and_each_placeholder_path_resolves():
    routes = dict(http_routes())
    names = {route.strip("^$") for route in routes}
    assert OPEN_ROUTES <= names  # the allow-list names real routes
    assert any(route.startswith(STAFF_ONLY_PREFIX) for route in names)
    for route, path in keyed_routes():
        assert resolve(path).func == routes[route], f"{path} does not resolve to the view of {route}"
    # Every public family is enumerated, so the walk cannot silently skip an include().
    for expected in ("v1/chat/completions", "v1/files", "v1/batches", "api/models", "api/probes", "metrics"):
        assert any(expected in route for route in names), expected
    assert len(keyed_routes()) >= 25
    assert websocket_routes() == ["/ws/batches/" + PLACEHOLDERS["batch_id"] + "/", "/ws/batches/"]
    assert socketio_path() == "/socket.io/"


def test_the_asgi_application_routes_nothing_the_enumeration_does_not_see():
    """HTTP: /socket.io/ to python-socketio, STATIC_URL to the admin's assets, the rest through the
    body guard to Django's resolver; WebSocket: /socket.io/, else the URLRouter. Another mount
    point changes this chain and must be enumerated above."""
    from django.core.handlers.asgi import ASGIHandler

    from millm_site.asgi import application

    assert set(application.application_mapping) == {"http", "websocket"}
    http = application.application_mapping["http"]
    chain = [type(http).__name__, type(http.other).__name__, type(http.other.app).__name__]
    assert chain == ["SocketIORouter", "BodyLimitASGI", "StaticFiles"]
    assert isinstance(http.other.app.application, ASGIHandler)
    assert [type(layer).__name__ for layer in websocket_chain(application)] == [
        "SocketIORouter", "CookieMiddleware", "SessionMiddleware", "AuthMiddleware", "URLRouter"]


def assert_refused(response, path):
    assert response.status_code == 401, f"{response.request.method} {path}: {response.status_code} {response.text[:200]}"
    assert response.headers["x-should-retry"] == "false"
    if response.request.method == "HEAD":
        return
    body = response.json()
    if path.startswith("/api/"):
        assert set(body) == {"success", "data", "error"} and body["success"] is False and body["data"] is None
        assert set(body["error"]) == {"code", "message", "details"}
        assert body["error"]["code"] == "INVALID_API_KEY"
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "authentication_error"
    assert "MILLM_API_KEYS" in body["error"]["message"]


@pytest.mark.parametrize("route,path", keyed_routes(), ids=[route for route, _ in keyed_routes()])
def test_every_route_but_health_refuses_a_caller_without_the_key(secured, route, path):
    url = secured.keyed.url + urllib.parse.quote(path, safe="/:")
    with httpx.Client(timeout=30) as http:
        for method in METHODS + ["HEAD"]:
            assert_refused(http.request(method, url), path)
        assert_refused(http.post(url, headers={"Authorization": "Bearer wrong-key"}, json={}), path)
        assert_refused(http.get(url, headers={"Authorization": f"Basic {KEY}"}), path)
        assert_refused(http.get(url + f"?token={KEY}"), path)  # the query token is for WebSocket and Socket.IO only
        keyed = http.get(url, headers=WITH_KEY)
        assert keyed.status_code != 401, f"GET {path} with the key: {keyed.text[:200]}"
        other = http.get(url, headers={"Authorization": f"Bearer {OTHER_KEY}"})
        assert other.status_code == keyed.status_code


@pytest.mark.parametrize("path", sorted(OPEN_ROUTES))
def test_health_answers_without_a_key(secured, path):
    response = httpx.get(secured.keyed.url + "/" + path, timeout=10)
    assert response.status_code == 200
    assert response.json()["status"] in ("ok", "degraded")


def test_websocket_and_socketio_refuse_a_client_without_the_key(secured):
    import socketio
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    base = secured.keyed.url.replace("http://", "ws://")

    async def scenario():
        for path in websocket_routes():
            for url in (base + path, base + path + "?token=wrong"):
                with pytest.raises(InvalidStatus) as refused:
                    async with connect(url, open_timeout=10) as connection:
                        await asyncio.wait_for(connection.recv(), 5)
                assert refused.value.response.status_code == 403
            async with connect(base + path + f"?token={KEY}", open_timeout=10) as allowed:
                assert allowed.protocol.state.name == "OPEN"
            async with connect(base + path, additional_headers=WITH_KEY, open_timeout=10) as allowed:
                assert allowed.protocol.state.name == "OPEN"
        for auth in (None, {"token": "wrong"}, {"token": 42}):
            client = socketio.AsyncClient()
            with pytest.raises(socketio.exceptions.ConnectionError):
                await client.connect(secured.keyed.url, transports=["websocket"], auth=auth,
                                     socketio_path=socketio_path(), wait_timeout=10)
            assert not client.connected
        for url, way in ((secured.keyed.url, {"auth": {"token": KEY}}), (secured.keyed.url, {"headers": WITH_KEY}),
                         (secured.keyed.url + f"?token={KEY}", {})):
            client = socketio.AsyncClient()
            await client.connect(url, transports=["websocket"], socketio_path=socketio_path(), wait_timeout=10, **way)
            assert client.connected
            await client.disconnect()

    asyncio.run(scenario())
    # HTTP long-polling, spoken by hand (the client library takes a ping interval to give up):
    # the namespace's CONNECT is answered CONNECT_ERROR (44) without the key, CONNECT (40) with it.
    for auth, answer in ((None, "44"), ({"token": "wrong"}, "44"), ({"token": KEY}, "40")):
        assert socketio_polling_connect(secured.keyed.url, auth).startswith(answer), auth


def socketio_polling_connect(url, auth):
    """Engine.IO v4 handshake over polling, then the Socket.IO CONNECT packet; the server's answer."""
    endpoint = url + socketio_path()
    with httpx.Client(timeout=10) as http:
        handshake = http.get(endpoint, params={"EIO": "4", "transport": "polling"})
        session = {"EIO": "4", "transport": "polling", "sid": json.loads(handshake.text[1:])["sid"]}
        http.post(endpoint, params=session, content="40" + (json.dumps(auth) if auth else "")).raise_for_status()
        return http.get(endpoint, params=session).text


# --- the admin ---


def make_users(stack):
    script = (
        "from django.contrib.auth.models import User\n"
        f"User.objects.create_superuser({STAFF[0]!r}, 'op@example.com', {STAFF[1]!r})\n"
        f"User.objects.create_user({NOT_STAFF[0]!r}, 'v@example.com', {NOT_STAFF[1]!r})\n"
    )
    subprocess.run([sys.executable, "manage.py", "shell", "-c", script], cwd=ROOT, env=stack.env, check=True,
                   capture_output=True)


@contextlib.contextmanager
def admin_login(url, username, password):
    """A browser-like session after the admin's login form was sent (CSRF token included)."""
    with httpx.Client(base_url=url, timeout=30) as http:
        form = http.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
        http.post("/admin/login/?next=/admin/", data={"username": username, "password": password,
                                                      "csrfmiddlewaretoken": token, "next": "/admin/"})
        yield http


@pytest.fixture(scope="module")
def users(secured):
    make_users(secured)


def test_the_admin_needs_a_staff_login_and_the_api_key_does_not_open_it(secured, users):
    url = secured.keyed.url
    for path in ("/admin/", "/admin/inference_app/lease/", "/admin/batches_app/batch/", "/admin/files_app/file/"):
        for headers in ({}, WITH_KEY):
            response = httpx.get(url + path, headers=headers)
            assert response.status_code == 302, (path, response.status_code)
            assert response.headers["Location"].startswith("/admin/login/")
    with admin_login(url, *NOT_STAFF) as visitor:
        assert visitor.get("/admin/").status_code == 302
        assert visitor.get("/admin/inference_app/lease/").status_code == 302
    with admin_login(url, *STAFF) as operator:
        index = operator.get("/admin/")
        assert index.status_code == 200 and "Site administration" in index.text


# --- lease ids ---


def test_a_lease_id_appears_in_the_grant_and_nowhere_else(secured, users):
    url = secured.keyed.url
    http = httpx.Client(base_url=url, headers=WITH_KEY, timeout=60)
    grant = http.post(f"/api/models/{MODEL_ID}/lease", json={"holder": "alice", "reason": "probe sweep", "ttl_seconds": 600})
    assert grant.status_code == 201, grant.text
    lease_id = grant.json()["data"]["id"]
    assert lease_id.startswith("lease_") and grant.text.count(lease_id) == 1
    held = {"X-miLLM-Lease": lease_id}
    seen = []  # every response after the grant

    def call(method, path, **kwargs):
        response = http.request(method, path, **kwargs)
        seen.append((f"{method} {path}", response))
        return response

    try:
        call("GET", "/api/health")
        detailed = call("GET", "/api/health/detailed")
        assert detailed.json()["lease"]["holder"] == "alice"
        assert call("GET", f"/api/models/{MODEL_ID}/lease").json()["data"]["holder"] == "alice"
        assert call("POST", f"/api/models/{MODEL_ID}/lease/renew", headers=held).status_code == 200
        assert call("POST", f"/api/models/{MODEL_ID}/unload").status_code == 409  # another caller: names the holder
        assert call("POST", f"/api/models/{MODEL_ID}/lease", json={"holder": "bob", "reason": "x"}).status_code == 409
        assert call("POST", f"/api/models/{MODEL_ID}x/lease/renew", headers=held).status_code == 404
        for path in ("/v1/models", f"/v1/models/{MODEL_ID}", "/api/models", f"/api/models/{MODEL_ID}", "/metrics"):
            assert call("GET", path).status_code == 200
        call("POST", "/v1/chat/completions", headers=held,
             json={"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        uploaded = call("POST", "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", to_jsonl(
            [line(f"r{i}", "/v1/completions", {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2}) for i in range(3)]))})
        created = call("POST", "/v1/batches", headers=held, json={
            "input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        wait_until(lambda: http.get(f"/v1/batches/{batch_id}").json()["status"] in FINISHED, 60, "the batch did not end")
        batch = call("GET", f"/v1/batches/{batch_id}").json()
        assert batch["status"] == "completed" and batch["millm"]["lease_mode"] == "caller"
        call("GET", "/v1/batches")
        call("POST", f"/v1/batches/{batch_id}/lease", headers=held)  # a finished batch: 409, naming the status
        call("GET", f"/v1/files/{batch['output_file_id']}/content")
        with admin_login(url, *STAFF) as operator:
            (lease_pk,) = secured.sql("SELECT id FROM inference_app_lease WHERE holder = 'alice'")[0]
            for path in ("/admin/", "/admin/inference_app/lease/", f"/admin/inference_app/lease/{lease_pk}/change/",
                         "/admin/batches_app/batch/", f"/admin/batches_app/batch/{quote(batch_id)}/change/",
                         "/admin/inference_app/engine/", "/admin/inference_app/modelentry/"):
                page = operator.get(path)
                assert page.status_code == 200, (path, page.headers.get("Location"))
                seen.append((f"admin {path}", page))
        released = call("DELETE", f"/api/models/{MODEL_ID}/lease", headers=held)
        assert released.status_code == 200 and released.json()["data"]["released"] is True
    finally:
        http.delete(f"/api/models/{MODEL_ID}/lease", headers=held)
        http.close()

    for label, response in seen:
        assert lease_id not in response.text, f"the lease id is in the answer of {label}"
        assert all(lease_id not in value for value in response.headers.values()), f"the lease id is in a header of {label}"
    for process in secured.processes:
        assert lease_id not in process.log(), f"the lease id is in the {process.name} log"
    assert lease_id not in database_text(secured), "the lease id is stored in clear"


def database_text(stack):
    """Every row of every table of the stack's database, as text."""
    tables = [name for (name,) in stack.sql(
        "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename")]
    return "\n".join(row for table in tables for (row,) in stack.sql(f'SELECT t::text FROM "{table}" t'))


# --- file content stays inside storage ---


def raw_get(url, path):
    """GET a path exactly as written (httpx would normalise the dot segments away)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode("latin-1"), body


def test_file_content_cannot_be_read_outside_storage(secured):
    url = secured.keyed.url
    http = httpx.Client(base_url=url, headers=WITH_KEY, timeout=30)
    marker = b'{"marker": "inside-storage-8d1e"}\n'
    file_id = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", marker)}).json()["id"]
    assert http.get(f"/v1/files/{file_id}/content").content == marker  # the route works for a real id
    ((storage_name,),) = secured.sql("SELECT storage_name FROM files_app_file WHERE id = %s", [file_id])
    absolute = str(secured.data_dir / storage_name)
    hostile_ids = ["../../../../etc/passwd", "/etc/passwd", "..", "%2e%2e", storage_name, absolute,
                   f"{file_id}.jsonl", f"../files/{file_id}", "files/../../../etc/passwd", "~root"]
    for hostile in hostile_ids:
        for suffix in ("/content", ""):
            path = "/v1/files/" + urllib.parse.quote(hostile, safe="") + suffix
            response = http.get(path)
            assert response.status_code == 404, (path, response.text)
            assert response.json()["error"]["code"] in ("not_found", "file_not_found")
            assert b"root:" not in response.content and b"inside-storage" not in response.content
    for path in ("/v1/files/../../../../etc/passwd/content", "/v1/files/..%2f..%2f..%2fetc%2fpasswd/content",
                 f"/v1/files/{file_id}/../../../../etc/passwd"):
        status, head, body = raw_get(url, path)
        assert status == 404, (path, head)
        assert b"root:" not in body
    for path in ("/static/../millm_site/settings.py", "/static/..%2f..%2fmillm_site%2fsettings.py",
                 "/static/admin/../../../../etc/passwd", "/static//etc/passwd"):
        status, head, body = raw_get(url, path)
        assert status == 404, (path, head)
        assert b"SECRET_KEY" not in body and b"root:" not in body
    # A record whose storage name points outside storage (a tampered row) is not read either.
    secured.sql("UPDATE files_app_file SET storage_name = %s WHERE id = %s RETURNING id",
                ["../../../../../../etc/passwd", file_id])
    tampered = http.get(f"/v1/files/{file_id}/content")
    assert tampered.status_code == 404 and tampered.json()["error"]["code"] == "file_not_found"
    assert b"root:" not in tampered.content
    http.close()
