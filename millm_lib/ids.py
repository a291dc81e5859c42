"""Object ids (SPEC 1): a prefix and 24 hex characters."""

import secrets


def new_id(prefix):
    return f"{prefix}{secrets.token_hex(12)}"
