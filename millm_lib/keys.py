"""Bearer keys: the one reading of `Authorization: Bearer <key>` and the one comparison, shared by
the HTTP middleware, the WebSocket consumer and the Socket.IO server."""

import hmac
from urllib.parse import parse_qs, urlsplit


def bearer_token(header):
    """The key in an Authorization header's value (str or latin-1 bytes), or "" without one."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    header = header or ""
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


def key_is_valid(token, keys):
    # Compared in constant time against every key, so timing says nothing about which matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token.encode(), key.encode())
    return matched


def socket_key(header, query_string, auth=None):
    """The key a WebSocket or Socket.IO client presents: Socket.IO's `auth={"token": ...}`, then
    the Authorization header as on HTTP routes, then `?token=` (browsers cannot set headers on a
    WebSocket). "" when none is presented."""
    token = auth.get("token") if isinstance(auth, dict) else None
    if token:
        return token if isinstance(token, str) else ""  # a number or an object is no key
    if isinstance(query_string, bytes):
        query_string = query_string.decode("utf-8", "replace")
    return bearer_token(header) or (parse_qs(query_string or "").get("token") or [""])[0]


def origin_allowed(origin, host, allowed=()):
    """A browser's socket may connect from the site's own origin (its host is the Host the
    request was sent to) or from one `allowed` names (MILLM_ALLOWED_ORIGINS). No Origin at all is
    not a browser (a browser always sends one on a WebSocket): the key check decides alone."""
    if not origin:
        return True
    if origin in allowed:
        return True
    return bool(host) and urlsplit(origin).netloc == host
