"""Object ids (SPEC 1): a prefix and 24 hex characters."""

import secrets

# The longest object id a route looks up (files, batches, webhook endpoints, probes, responses):
# their id columns are this long, and the schema documents it on each `{..._id}` of a path.
MAX_LENGTH = 40
# A catalogue id is an operator's choice, not a made one (POST /api/models takes `id`).
MODEL_ID_MAX_LENGTH = 255


def new_id(prefix):
    return f"{prefix}{secrets.token_hex(12)}"


def path_id_schema(name):
    """The schema of a path's id parameter: as long as the ids it can name."""
    return {"type": "string", "minLength": 1, "maxLength": MODEL_ID_MAX_LENGTH if name == "model_id" else MAX_LENGTH}
