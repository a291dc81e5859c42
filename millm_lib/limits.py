"""Endpoint names and the limits more than one app checks: one spelling each."""

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
PROBE_SCORE = "/api/probes/score"
RESPONSES = "/v1/responses"  # served as a chat completion (responses_app)

GENERATION_ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES)  # rows that decode tokens
PACKABLE_ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)  # rows that can share a right-padded pack
BATCH_ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS, PROBE_SCORE, RESPONSES)  # what a batch may name

# OpenAI's range for a file's expires_after (an upload's, and a batch's output files'), seconds.
EXPIRES_AFTER_MIN_S = 3_600
EXPIRES_AFTER_MAX_S = 2_592_000
