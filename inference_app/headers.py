"""The request headers a generation route reads (/v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/responses), as /api/schema/ documents them."""

from inference_app.leases import LEASE_HEADER
from millm_lib.openapi import header

STRICT_HEADER_DOC = header(
    "X-miLLM-Strict", {"type": "string", "enum": ["true", "false", "1", "0"]},
    "Strict mode refuses unused fields (unused_fields_refused); case-insensitive",
)
LOAD_POLICY_HEADER_DOC = header(
    "X-miLLM-Load-Policy", {"type": "string", "enum": ["auto", "refuse"]},
    "refuse: 409 model_not_resident instead of loading the model",
)
LEASE_HEADER_DOC = header(LEASE_HEADER, {"type": "string"}, "A lease id: act despite your own lease")
GENERATION_HEADERS = (STRICT_HEADER_DOC, LOAD_POLICY_HEADER_DOC, LEASE_HEADER_DOC)
