"""The bodies the inference app sends: /v1 answers and chunks, health, and the management data
(catalogue, leases, weights, probes). The server builds each body by calling its shape, and
/api/schema/ documents the same classes (millm_lib.shapes says how)."""

from typing import Annotated, Literal, Union

from pydantic import Field
from typing_extensions import NotRequired

from millm_lib.shapes import Shape

FinishReason = Literal["stop", "length", "tool_calls"]
ModelState = Literal["available", "loading", "resident", "unloading", "error"]
WeightsFlag = Literal["clean", "torn"]


# --- /v1 inference ---


class PromptTokensDetails(Shape):
    cached_tokens: int  # the prompt's tokens a cached prefix held (prefix reuse), not run again


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: NotRequired[PromptTokensDetails]  # only where a prefix was reused


class TopLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Shape):
    content: list[TokenLogprob]
    refusal: None


class FunctionCall(Shape):
    name: str
    arguments: str  # JSON text


class ToolCall(Shape):
    id: Annotated[str, Field(pattern=r"^call_")]
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(Shape):
    role: Literal["assistant"]
    content: str | None  # None when the answer is a tool call
    refusal: None
    tool_calls: NotRequired[list[ToolCall]]


class ChatChoice(Shape):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(Shape):
    id: Annotated[str, Field(pattern=r"^chatcmpl-")]
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(Shape):
    name: NotRequired[str]
    arguments: NotRequired[str]  # a piece of the JSON text


class ToolCallDelta(Shape):
    index: int
    id: NotRequired[Annotated[str, Field(pattern=r"^call_")]]
    type: NotRequired[Literal["function"]]
    function: NotRequired[FunctionCallDelta]


class ChatDelta(Shape):
    role: NotRequired[Annotated[Literal["assistant"] | None, Field(default=None)]]
    content: NotRequired[Annotated[str | None, Field(default=None)]]
    tool_calls: NotRequired[list[ToolCallDelta]]


class ChatChunkChoice(Shape):
    index: int
    delta: ChatDelta
    logprobs: None
    finish_reason: FinishReason | None


class ChatCompletionChunk(Shape):
    id: Annotated[str, Field(pattern=r"^chatcmpl-")]
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: NotRequired[Annotated[Usage | None, Field(default=None)]]


class CompletionLogprobs(Shape):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(Shape):
    id: Annotated[str, Field(pattern=r"^cmpl-")]
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(Shape):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason | None


class CompletionChunk(Shape):
    id: Annotated[str, Field(pattern=r"^cmpl-")]
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChunkChoice]
    usage: NotRequired[Annotated[Usage | None, Field(default=None)]]


class Embedding(Shape):
    object: Literal["embedding"]
    index: int
    # float: a list of numbers; base64: little-endian float32 bytes.
    embedding: Union[list[float], str]


class EmbeddingUsage(Shape):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: NotRequired[PromptTokensDetails]  # only where a prefix was reused


class EmbeddingList(Shape):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelMillm(Shape):
    kind: Literal["catalogue", "checkpoint"]
    state: ModelState


class ModelObject(Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    millm: ModelMillm


class ModelList(Shape):
    object: Literal["list"]
    data: list[ModelObject]


# --- health ---


class Health(Shape):
    status: Literal["ok"]
    version: str
    timestamp: int


class LeaseStatus(Shape):
    model_id: str
    holder: str
    reason: str
    acquired_at: int
    renewed_at: int
    expires_at: int
    ttl_seconds: int
    seconds_remaining: int


class BatchWork(Shape):
    """The batch an engine runs rows of: as its leader (it holds the batch's claim) or a helper
    (a replica running chunks of a batch another replica leads, SPEC 10c)."""

    batch: str
    role: Literal["leader", "helper"]
    rows_run: int


class EngineHealth(Shape):
    id: str
    alive: bool
    last_heartbeat: int
    model: str | None
    role: Literal["active", "standby"]
    resident_model: str | None
    loading_model: str | None
    weights: WeightsFlag
    seat: int | None
    queue_waiting: int
    in_flight: int
    sequences_running: int
    batch_work: BatchWork | None


class InferenceHealth(Shape):
    backend: Literal["serial", "batched"]
    queue_pending: int
    queue_max_concurrent: int
    queue_max_pending: int
    in_flight: int
    queue_waiting: int
    estimated_wait_seconds: float | None
    batch_backlog_rows: int | None


class HealthDetailed(Shape):
    status: Literal["ok", "degraded"]
    version: str
    timestamp: int
    model_loaded: bool
    model_name: str | None
    lease: LeaseStatus | None
    engines: list[EngineHealth]
    inference: InferenceHealth


# --- management (/api): the `data` of the success envelope ---


class CatalogueEntry(Shape):
    id: str
    kind: Literal["catalogue", "checkpoint"]
    source: str
    format: Literal["folder", "gguf", "safetensors"]
    revision: str | None
    dtype: str | None
    quantization: str | None
    chat_template: str | None
    context_length: int | None
    hidden_size: int | None
    num_layers: int | None
    base: str | None
    state: ModelState
    state_detail: str | None
    weights: WeightsFlag
    created_at: int


class ControlAccepted(Shape):
    """A load or unload the engine took on (202); progress shows in the entry's state."""

    model: CatalogueEntry
    engine: str


class LeaseAcquired(LeaseStatus):
    id: Annotated[str, Field(description="The lease id: shown in this response only")]


class LeaseReleased(LeaseStatus):
    released: Literal[True]


class WeightsState(Shape):
    model: str
    weights: WeightsFlag
    written: NotRequired[Annotated[list[str] | None, Field(default=None)]]


class SavedCheckpoint(Shape):
    model: str
    base: str | None
    renamed_from: str
    revision: str | None
    path: str


class ProbeSummary(Shape):
    id: str
    name: str
    model: str
    layer: int
    d_model: int
    aggregation: Literal["mean", "max", "last"]
    threshold: float | None
    created_at: int


class ProbeDetail(ProbeSummary):
    weights: list[float]
    bias: float
    norm_mean: Union[float, list[float]]
    norm_std: Union[float, list[float]]


class ProbeDeleted(Shape):
    id: str
    deleted: Literal[True]


class ProbeVerdict(Shape):
    probe_id: str
    name: str
    window: Literal["all", "prompt", "response"]
    threshold: float | None
    score: float | None
    verdict: bool | None
    not_scored_reason: NotRequired[Annotated[str | None, Field(default=None)]]


class ProbeResult(Shape):
    index: int
    n_tokens: int
    prompt_tokens: int
    token_ids: NotRequired[Annotated[list[int] | None, Field(default=None)]]
    verdicts: list[ProbeVerdict]


class ScoredModel(Shape):
    id: str


class ProbeScores(Shape):
    model: ScoredModel
    results: list[ProbeResult]
