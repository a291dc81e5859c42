"""Where the server may send webhooks: every URL an endpoint names is checked when it is set and
again before each attempt (MILLM_WEBHOOK_ALLOWED_HOSTS may have changed since)."""

from urllib.parse import urlsplit

import httpx
from django.conf import settings

URL_MAX = 2048


def url_problem(url):
    """Why `url` may not receive webhooks (a sentence), or None when it may."""
    if not isinstance(url, str) or not url:
        return f"url must be an http(s) URL, got {url!r}"
    if len(url) > URL_MAX:
        return f"url is {len(url)} characters; the limit is {URL_MAX}"
    if any(character.isspace() or ord(character) < 32 for character in url):
        return "url must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number from 0 to 65535)
        httpx.URL(url).host  # noqa: B018 (the sender's own parse: a host IDNA refuses, "xn--a.com", is never sent to)
    except (ValueError, httpx.InvalidURL) as error:
        return f"url is not a valid URL: {error}"
    if parts.scheme not in ("http", "https"):
        return f"url must be http or https, got {parts.scheme or 'no scheme'!r}"
    if parts.username is not None or parts.password is not None:
        return "url must not carry credentials (user:password@); authenticate the receiver by the signature"
    if not parts.hostname:
        return "url has no host"
    if not host_allowed(parts.hostname):
        return (f"the host {parts.hostname!r} is not in MILLM_WEBHOOK_ALLOWED_HOSTS "
                f"({', '.join(settings.MILLM_WEBHOOK_ALLOWED_HOSTS)})")
    return None


def host_allowed(host):
    """Any host when MILLM_WEBHOOK_ALLOWED_HOSTS is empty; else a host it names, or one under a
    `*.example.com` (or `.example.com`) entry."""
    allowed = settings.MILLM_WEBHOOK_ALLOWED_HOSTS
    if not allowed:
        return True
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if entry.startswith("*."):
            entry = entry[1:]
        if host == entry or (entry.startswith(".") and host.endswith(entry)):
            return True
    return False
