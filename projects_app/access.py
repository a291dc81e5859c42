"""Which project a presented key is, for the HTTP middleware, the WebSocket consumer and the
Socket.IO server alike (SPEC 10d)."""

from django.conf import settings

from millm_lib.keys import key_is_valid
from projects_app.models import ApiKey, Project


def keys_required():
    """Keys are needed once MILLM_API_KEYS is set or any key was ever made (a revoked one
    included: revoking the last key never opens the server)."""
    return bool(settings.MILLM_API_KEYS) or ApiKey.objects.exists()


def project_for_key(token):
    """The project `token` belongs to, or None when it is no active key. While no key is
    needed, every caller is the default project."""
    if not keys_required():
        return Project.objects.default()
    if not token:
        return None
    if settings.MILLM_API_KEYS and key_is_valid(token, settings.MILLM_API_KEYS):
        return Project.objects.default()
    return ApiKey.objects.project_of(token)
