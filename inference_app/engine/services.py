"""The service functions: the ONLY code that runs the model.

A synchronous request and a batch row call the same function with a ParsedRequest (from
`inference_app.schemas.parse_request`) and get a ServiceResult: the response body and the
provenance headers the route sets. Refusals raise ApiError. Streaming variants return the
headers first and then an iterator of chunks; the iterator runs the model as it is consumed,
so it must be consumed in the model thread, under the admission slot.
"""

import base64
import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from millm_lib.errors import ApiError
from millm_lib.ids import new_id
from millm_lib.limits import CHAT, COMPLETIONS, EMBEDDINGS, PROBE_SCORE
from millm_lib.shapes import ManagementSuccess
from inference_app.engine.controls import Controls
from inference_app.engine.grammars import compile_grammar
from inference_app.provenance import provenance_headers
from inference_app.schemas import SEED_MAX
from inference_app.structured import grammar_kind, grammar_sha
from inference_app.tools import CallStream, decoding_format, read_calls, renders_tools, tool_calls
from inference_app.shapes import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    Embedding,
    EmbeddingList,
    EmbeddingUsage,
    ProbeResult,
    ProbeScores,
    ProbeVerdict,
    PromptTokensDetails,
    ScoredModel,
    TokenLogprob,
    TopLogprob,
    Usage,
)

DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass
class ServiceResult:
    body: dict
    headers: dict


def never_cancelled():
    return False


def run(runtime, parsed, cancelled=never_cancelled, probes=None):
    """Answer one non-streamed request (`probes`: the specs a probe-score request scores)."""
    check_model(runtime, parsed)
    check_controls(runtime, parsed)
    if parsed.endpoint == PROBE_SCORE:
        return probe_score(runtime, parsed, probes)
    if parsed.endpoint == CHAT:
        result = chat_completion(runtime, parsed, cancelled)
    elif parsed.endpoint == COMPLETIONS:
        result = completion(runtime, parsed, cancelled)
    else:
        return embeddings(runtime, parsed)
    # A seated generation's prefill may have begun from a cached prefix (prefix_cache.py).
    return with_reuse(result, getattr(runtime, "prefix_tokens_reused", 0))


def with_reuse(result, tokens):
    """`result` saying that `tokens` of its prompt were a cached prefix's, not run again (the
    usage's `prompt_tokens_details.cached_tokens`, as OpenAI reports its own prompt caching)."""
    if tokens:
        result.body["usage"]["prompt_tokens_details"] = PromptTokensDetails(cached_tokens=tokens)
    return result


def stream(runtime, parsed, cancelled=never_cancelled):
    """Headers, then an iterator of SSE chunk objects, for a streamed chat or completion."""
    check_model(runtime, parsed)
    check_controls(runtime, parsed)
    if parsed.endpoint == CHAT:
        return chat_completion_stream(runtime, parsed, cancelled)
    return completion_stream(runtime, parsed, cancelled)


def check_model(runtime, parsed):
    name = getattr(parsed.request, "model", None)
    if name is not None and name != runtime.model_id:
        raise ApiError(
            404,
            "model_not_found",
            f"The model '{name}' is not resident on this engine; it serves '{runtime.model_id}'",
            param="model",
        )


def check_controls(runtime, parsed):
    """What only the engine can check, before any forward pass or streamed byte: a biased id
    outside the vocabulary, and a `response_format` whose grammar cannot be built, are 400s
    naming the field."""
    outside = sorted(int(token) for token in getattr(parsed.request, "logit_bias", None) or {}
                     if int(token) >= runtime.vocab_size)
    if outside:
        raise ApiError(
            400,
            "invalid_parameter",
            f"Invalid value for 'logit_bias': token id {outside[0]} is outside the vocabulary of {runtime.vocab_size} "
            f"tokens (0 to {runtime.vocab_size - 1})",
            param="logit_bias",
        )
    decoded, param = decoding_format(parsed.request)
    if grammar_kind(decoded) is not None:
        compile_grammar(runtime, decoded, param)  # cached: the sequence's own state reuses it


def headers_for(runtime, parsed):
    """The route's provenance headers; X-miLLM-Backend is `batched` once a sequence of this
    request shared a decode step with another (a seated runtime knows; the model alone never
    shares)."""
    headers = provenance_headers(runtime.model_id, parsed.endpoint, parsed.request, parsed.ignored)
    decoded, param = decoding_format(parsed.request)
    kind = grammar_kind(decoded)
    if kind is not None:  # the answer was decoded under a grammar (SPEC 4a)
        headers["X-miLLM-Grammar"] = f"{'tool_call' if param == 'tools' else kind};sha={grammar_sha(decoded)}"
    if getattr(runtime, "shared", False):
        headers["X-miLLM-Backend"] = "batched"
    return headers


# --- chat ---


def chat_completion(runtime, parsed, cancelled=never_cancelled):
    request = parsed.request
    if request.is_scoring():
        return score(runtime, parsed)
    prompt_ids = chat_prompt(runtime, request)
    max_tokens = _max_tokens(runtime, prompt_ids, request.requested_max_tokens(), DEFAULT_CHAT_MAX_TOKENS, "messages")
    assemblers = _generate_choices(runtime, request, prompt_ids, max_tokens, cancelled)
    choices = []
    for index, assembler in enumerate(assemblers):
        content, calls = read_calls(request, assembler.text)
        message = AssistantMessage(role="assistant", content=content, refusal=None)
        if calls:
            message["tool_calls"] = tool_calls(calls)
        finish_reason = "tool_calls" if calls and assembler.finish_reason == "stop" else assembler.finish_reason
        logprobs = _chat_logprobs(runtime, request, assembler, assembler.logprobs)
        choices.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish_reason))
    usage = _usage(len(prompt_ids), sum(assembler.produced for assembler in assemblers))
    return ServiceResult(_chat_body(runtime, choices, usage), headers_for(runtime, parsed))


def chat_prompt(runtime, request):
    """A chat request's prompt tokens: its messages, and the tools it shows the model."""
    return runtime.encode(runtime.render_chat(request.messages, renders_tools(request)))


def _chat_body(runtime, choices, usage):
    return ChatCompletion(
        id=new_id("chatcmpl-"),
        object="chat.completion",
        created=int(time.time()),
        model=runtime.model_id,
        system_fingerprint=runtime.fingerprint,
        choices=choices,
        usage=usage,
    )


def chat_completion_stream(runtime, parsed, cancelled=never_cancelled):
    request = parsed.request
    prompt_ids = chat_prompt(runtime, request)
    max_tokens = _max_tokens(runtime, prompt_ids, request.requested_max_tokens(), DEFAULT_CHAT_MAX_TOKENS, "messages")
    # A chunk per token: what every chunk of this stream repeats is built once.
    head = ChatCompletionChunk(id=new_id("chatcmpl-"), object="chat.completion.chunk", created=int(time.time()),
                               model=runtime.model_id, system_fingerprint=runtime.fingerprint, choices=[])

    def chunk(index, delta, finish_reason=None, logprobs=None):
        body = head.copy()
        body["choices"] = [ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)]
        return body

    def pieces_of(index, pieces):
        """A chunk per piece; the first carries the logprobs of the tokens since the last chunk."""
        for number, piece in enumerate(pieces):
            logprobs = None
            if number == 0:
                assembler = assemblers[index]
                logprobs = _chat_logprobs(runtime, request, assembler, assembler.take_logprobs())
            yield chunk(index, ChatDelta(**piece), logprobs=logprobs)

    assemblers = [TextAssembler(runtime, request.stop_sequences()) for _ in range(request.n)]

    def chunks():
        calls = [CallStream(request) for _ in assemblers]  # text as content, or tool_calls deltas (tools.py)
        for index in range(request.n):
            yield chunk(index, ChatDelta(role="assistant", content=""))
        for index, delta in _choice_deltas(runtime, request, prompt_ids, max_tokens, cancelled, assemblers):
            yield from pieces_of(index, calls[index].feed(delta))
        for index, (assembler, call) in enumerate(zip(assemblers, calls)):
            yield from pieces_of(index, call.finish())
            called = call.called and assembler.finish_reason == "stop"
            yield chunk(index, ChatDelta(), "tool_calls" if called else assembler.finish_reason)
        if request.include_usage():
            yield {**head, "usage": _usage(len(prompt_ids), sum(assembler.produced for assembler in assemblers))}

    return headers_for(runtime, parsed), chunks()


# --- completions ---


def completion(runtime, parsed, cancelled=never_cancelled):
    """A choice for each prompt and each of the `n` (prompt by prompt: index = prompt x n + choice)."""
    request = parsed.request
    if request.is_scoring():
        return score(runtime, parsed)
    encoded = [runtime.encode(prompt) for prompt in request.prompts()]
    limits = [_max_tokens(runtime, ids, request.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "prompt") for ids in encoded]
    choices, prompt_tokens, produced = [], 0, 0
    for ids, limit in zip(encoded, limits):
        for assembler in _generate_choices(runtime, request, ids, limit, cancelled):
            logprobs = _completion_logprobs(runtime, request, assembler, assembler.logprobs)
            choices.append(CompletionChoice(index=len(choices), text=assembler.text, logprobs=logprobs,
                                            finish_reason=assembler.finish_reason))
            produced += assembler.produced
        prompt_tokens += len(ids)
    return ServiceResult(_completion_body(runtime, choices, _usage(prompt_tokens, produced)), headers_for(runtime, parsed))


def _completion_body(runtime, choices, usage):
    return Completion(
        id=new_id("cmpl-"),
        object="text_completion",
        created=int(time.time()),
        model=runtime.model_id,
        system_fingerprint=runtime.fingerprint,
        choices=choices,
        usage=usage,
    )


def completion_stream(runtime, parsed, cancelled=never_cancelled):
    request = parsed.request
    prompt_ids = runtime.encode(request.prompts()[0])
    max_tokens = _max_tokens(runtime, prompt_ids, request.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
    # A chunk per token: what every chunk of this stream repeats is built once.
    head = CompletionChunk(id=new_id("cmpl-"), object="text_completion", created=int(time.time()),
                           model=runtime.model_id, system_fingerprint=runtime.fingerprint, choices=[])

    def chunk(index, text, finish_reason=None):
        body = head.copy()
        assembler = assemblers[index]
        logprobs = _completion_logprobs(runtime, request, assembler, assembler.take_logprobs())
        body["choices"] = [CompletionChunkChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)]
        return body

    assemblers = [TextAssembler(runtime, request.stop_sequences()) for _ in range(request.n)]

    def chunks():
        for index, delta in _choice_deltas(runtime, request, prompt_ids, max_tokens, cancelled, assemblers):
            yield chunk(index, delta)
        for index, assembler in enumerate(assemblers):
            yield chunk(index, "", assembler.finish_reason)
        if request.include_usage():
            yield {**head, "usage": _usage(len(prompt_ids), sum(assembler.produced for assembler in assemblers))}

    return headers_for(runtime, parsed), chunks()


def _chat_logprobs(runtime, request, assembler, entries):
    """A generated chat choice's (or chunk's) logprobs: one entry per token in `entries` (of
    `assembler`'s), or None when the request did not ask."""
    if request.generated_logprobs() is None:
        return None
    content = [TokenLogprob(**_token_entry(runtime, assembler.token_ids[index], logprob),
                            top_logprobs=[_token_entry(runtime, token_id, value) for token_id, value in top])
               for index, _, logprob, top in entries]
    return ChatLogprobs(content=content, refusal=None)


def _completion_logprobs(runtime, request, assembler, entries):
    """A generated completion choice's (or chunk's) logprobs in the legacy shape, or None."""
    if request.generated_logprobs() is None:
        return None
    tops = []
    for _, _, _, top in entries:
        named = {}
        for token_id, value in top:
            named.setdefault(runtime.token_string(token_id), value)
        tops.append(named)
    return CompletionLogprobs(tokens=[runtime.token_string(assembler.token_ids[index]) for index, _, _, _ in entries],
                              token_logprobs=[logprob for _, _, logprob, _ in entries], top_logprobs=tops,
                              text_offset=[min(offset, len(assembler.text)) for _, offset, _, _ in entries])


# --- scoring, shared by chat and completions ---


def is_generation(parsed):
    """Chat and completions that generate (not scoring): these decode in the step scheduler."""
    return parsed.endpoint in (CHAT, COMPLETIONS) and not parsed.request.is_scoring()


def is_packable(parsed):
    """Scoring rows and embedding rows may run packed; generation and probe scores never."""
    if parsed.endpoint == EMBEDDINGS:
        return True
    return parsed.endpoint in (CHAT, COMPLETIONS) and parsed.request.is_scoring()


def plan(runtime, parsed):
    """The token sequences a packable request runs, each checked before any forward pass: one
    per prompt (scoring) or per input (embeddings). A refusal is the route's own ApiError."""
    request = parsed.request
    if parsed.endpoint == EMBEDDINGS:
        encoded = [runtime.encode(text) for text in request.inputs()]
        for index, ids in enumerate(encoded):
            if len(ids) > runtime.context_length:
                raise ApiError(
                    400,
                    "context_length_exceeded",
                    f"Input {index} is {len(ids)} tokens, over this model's maximum context length of "
                    f"{runtime.context_length} tokens; nothing was truncated",
                    param=f"input[{index}]",
                )
        return encoded
    if parsed.endpoint == CHAT:
        encoded, prompt_param = [chat_prompt(runtime, request)], "messages"
    else:
        encoded, prompt_param = [runtime.encode(prompt) for prompt in request.prompts()], "prompt"
    for ids in encoded:
        _check_context(runtime, len(ids), 1, prompt_param)
    outside = [token_id for token_id in request.allowed_token_ids or () if token_id >= runtime.vocab_size]
    if outside:
        raise ApiError(
            400,
            "invalid_scoring_request",
            f"allowed_token_ids holds {outside[0]}, outside the vocabulary of {runtime.vocab_size} tokens",
            param="allowed_token_ids",
        )
    return encoded


def score(runtime, parsed):
    """Scoring mode, one sequence per forward pass: the head runs at the last position only."""
    encoded = plan(runtime, parsed)
    return build(runtime, parsed, encoded, [runtime.last_logits(ids) for ids in encoded])


def build(runtime, parsed, encoded, outputs):
    """The response body from the forward passes' outputs (logits at each sequence's last
    token, or pooled vectors): the same builder for single and packed rows."""
    request = parsed.request
    if parsed.endpoint == EMBEDDINGS:
        body = _embeddings_body(runtime, request, encoded, outputs)
    elif parsed.endpoint == CHAT:
        count = _top_count(request.top_logprobs, request.allowed_token_ids)
        chosen, logprob, top = score_from_logits(outputs[0], request.temperature, request.allowed_token_ids, count)
        entry = TokenLogprob(**_token_entry(runtime, chosen, logprob),
                             top_logprobs=[_token_entry(runtime, token_id, value) for token_id, value in top])
        logprobs = ChatLogprobs(content=[entry], refusal=None)
        message = AssistantMessage(role="assistant", content=runtime.token_string(chosen), refusal=None)
        choice = ChatChoice(index=0, message=message, logprobs=logprobs, finish_reason="length")
        body = _chat_body(runtime, [choice], _usage(len(encoded[0]), 1))
    else:
        count = _top_count(request.logprobs, request.allowed_token_ids)
        choices = []
        for index, logits in enumerate(outputs):
            chosen, logprob, top = score_from_logits(logits, request.temperature, request.allowed_token_ids, count)
            token = runtime.token_string(chosen)
            top_map = {}
            for token_id, value in top:
                top_map.setdefault(runtime.token_string(token_id), value)
            choices.append(CompletionChoice(
                index=index,
                text=token,
                logprobs=CompletionLogprobs(tokens=[token], token_logprobs=[logprob], top_logprobs=[top_map], text_offset=[0]),
                finish_reason="length",
            ))
        usage = _usage(sum(len(ids) for ids in encoded), len(encoded))
        body = _completion_body(runtime, choices, usage)
    return ServiceResult(body, headers_for(runtime, parsed))


def score_from_logits(logits, temperature, allowed_token_ids, top_count):
    """The distribution at a prompt's last token (SPEC 4): divided by the temperature when not
    0, restricted and renormalised over `allowed_token_ids`. Returns (chosen id, its logprob,
    [(id, logprob)] of the `top_count` most probable, impossible tokens left out)."""
    if temperature:
        logits = logits / temperature
    if allowed_token_ids is not None:
        allowed = torch.tensor(sorted(set(allowed_token_ids)), dtype=torch.long, device=logits.device)
        restricted = torch.full_like(logits, -math.inf)
        restricted[allowed] = logits[allowed]
        logits = restricted
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = int(torch.argmax(logprobs))
    values, ids = torch.topk(logprobs, k=min(max(top_count, 1), logprobs.shape[0]))
    top = [(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist()) if math.isfinite(v)][:top_count]
    return chosen, float(logprobs[chosen]), top


def _top_count(requested, allowed_token_ids):
    if requested is not None:
        return requested
    return min(len(set(allowed_token_ids)), 20) if allowed_token_ids else 0


def _token_entry(runtime, token_id, logprob):
    return TopLogprob(token=runtime.token_string(token_id), logprob=logprob, bytes=runtime.token_bytes(token_id))


# --- embeddings ---


def embeddings(runtime, parsed):
    """Each input alone, unpadded; every input is checked before any forward pass."""
    request = parsed.request
    encoded = plan(runtime, parsed)
    vectors = [runtime.embed(ids, request.pooling, request.normalize) for ids in encoded]
    return build(runtime, parsed, encoded, vectors)


def _embeddings_body(runtime, request, encoded, vectors):
    data = [
        Embedding(object="embedding", index=index, embedding=encode_vector(vector, request.encoding_format))
        for index, vector in enumerate(vectors)
    ]
    tokens = sum(len(ids) for ids in encoded)
    return EmbeddingList(object="list", data=data, model=runtime.model_id,
                         usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def encode_vector(vector, encoding_format):
    values = vector.numpy().astype("<f4")
    if encoding_format == "base64":
        return base64.b64encode(values.tobytes()).decode("ascii")
    return values.astype(np.float64).tolist()


# --- probes ---


def probe_score(runtime, parsed, probes):
    """Score each input with each probe over each window (SPEC 4).

    One input per forward pass, never padded. Every input is checked before any forward pass.
    """
    request = parsed.request
    prepared = [_probe_tokens(runtime, item, index) for index, item in enumerate(request.inputs)]
    readers = [_ProbeReader(spec, runtime.device) for spec in probes]
    results = []
    for index, (token_ids, prompt_tokens) in enumerate(prepared):
        states = runtime.hidden_states(token_ids)
        verdicts = []
        for reader in readers:
            per_token = reader.per_token(states[reader.layer + 1][0])
            for window in request.windows:
                verdicts.append(reader.verdict(per_token, window, prompt_tokens))
        result = ProbeResult(index=index, n_tokens=len(token_ids), prompt_tokens=prompt_tokens, verdicts=verdicts)
        if request.return_token_ids:
            result["token_ids"] = token_ids
        results.append(result)
    scores = ProbeScores(model=ScoredModel(id=runtime.model_id), results=results)
    body = ManagementSuccess(success=True, data=scores, error=None)
    return ServiceResult(body, provenance_headers(runtime.model_id, PROBE_SCORE))


def _probe_tokens(runtime, item, index):
    """(token ids, prompt/response boundary) of one probe input."""
    param = f"inputs.{index}"
    if item.text is not None:
        token_ids = runtime.encode(item.text)
        prompt_tokens = len(token_ids)
    elif item.messages is not None:
        token_ids = runtime.encode(runtime.render_chat(item.messages))
        if item.messages[-1].role == "assistant" and len(item.messages) > 1:
            # The prompt is everything before the final assistant turn, rendered as the model
            # would see it when asked to answer.
            prompt_tokens = len(runtime.encode(runtime.render_chat(item.messages[:-1])))
        elif item.messages[-1].role == "assistant":
            prompt_tokens = 0
        else:
            prompt_tokens = len(token_ids)
    else:
        token_ids = list(item.token_ids)
        outside = [token for token in token_ids if token >= runtime.vocab_size]
        if outside:
            raise ApiError(
                400,
                "invalid_probe_score_request",
                f"Invalid value for '{param}.token_ids': {outside[0]} is outside the vocabulary of "
                f"{runtime.vocab_size} tokens",
                param=f"{param}.token_ids",
                details={"field": f"{param}.token_ids"},
            )
        prompt_tokens = item.prompt_tokens if item.prompt_tokens is not None else len(token_ids)
    if not token_ids:
        raise ApiError(400, "invalid_probe_score_request", f"Invalid value for '{param}': it has no tokens",
                       param=param, details={"field": param})
    if len(token_ids) > runtime.context_length:
        raise ApiError(
            400,
            "context_length_exceeded",
            f"Input {index} is {len(token_ids)} tokens, over this model's maximum context length of "
            f"{runtime.context_length} tokens; nothing was truncated",
            param=param,
            details={"field": param, "tokens": len(token_ids), "limit": runtime.context_length},
        )
    return token_ids, min(prompt_tokens, len(token_ids))


class _ProbeReader:
    """((h - norm_mean) / norm_std) . weights + bias per token, aggregated over a window."""

    def __init__(self, spec, device):
        self.spec = spec
        self.layer = spec["layer"]
        self.weights = torch.tensor(spec["weights"], dtype=torch.float32, device=device)
        self.mean = torch.tensor(spec["norm_mean"], dtype=torch.float32, device=device)
        self.std = torch.tensor(spec["norm_std"], dtype=torch.float32, device=device)
        self.bias = float(spec["bias"])

    def per_token(self, hidden):
        return ((hidden.float() - self.mean) / self.std) @ self.weights + self.bias

    def verdict(self, per_token, window, prompt_tokens):
        spec = self.spec
        selected = {"all": per_token, "prompt": per_token[:prompt_tokens], "response": per_token[prompt_tokens:]}[window]
        entry = {"probe_id": spec["id"], "name": spec["name"], "window": window, "threshold": spec["threshold"]}
        if selected.numel() == 0:
            reason = "the input has no response tokens" if window == "response" else "the input has no prompt tokens"
            return ProbeVerdict(**entry, score=None, verdict=None, not_scored_reason=reason)
        aggregation = spec["aggregation"]
        if aggregation == "mean":
            score = float(selected.mean())
        elif aggregation == "max":
            score = float(selected.max())
        else:
            score = float(selected[-1])
        verdict = None if spec["threshold"] is None else score >= spec["threshold"]
        return ProbeVerdict(**entry, score=score, verdict=verdict)


# --- generation helpers ---


def _max_tokens(runtime, prompt_ids, requested, default, prompt_param):
    """The request's max_tokens, or the default: a chat default never asks past the context."""
    if requested is None:
        requested = default
        if prompt_param == "messages":
            requested = max(1, min(default, runtime.context_length - len(prompt_ids)))
    _check_context(runtime, len(prompt_ids), requested, prompt_param)
    return requested


def _check_context(runtime, prompt_tokens, max_tokens, prompt_param):
    if prompt_tokens == 0:
        # "" encodes to nothing, and a forward pass needs at least one token.
        raise ApiError(
            400, "invalid_parameter",
            f"Invalid value for '{prompt_param}': the prompt encodes to no tokens; send some text",
            param=prompt_param,
        )
    if prompt_tokens + max_tokens <= runtime.context_length:
        return
    where = "messages" if prompt_param == "messages" else "prompt"
    raise ApiError(
        400,
        "context_length_exceeded",
        f"This model's maximum context length is {runtime.context_length} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in the completion). "
        "Reduce the length of the prompt or max_tokens; nothing was truncated.",
        param=prompt_param,
    )


def _generate_choices(runtime, request, prompt_ids, max_tokens, cancelled):
    """The request's `n` choices for one prompt, whole: a TextAssembler each (text, finish
    reason, tokens produced)."""
    assemblers = [TextAssembler(runtime, request.stop_sequences()) for _ in range(request.n)]
    for _ in _choice_deltas(runtime, request, prompt_ids, max_tokens, cancelled, assemblers):
        pass
    return assemblers


def choice_seeds(seed, count):
    """Choice i of a seeded request samples with seed + i (wrapping): the choices differ, and
    each repeats."""
    return [None if seed is None else (seed + index) % (SEED_MAX + 1) for index in range(count)]


def _choice_deltas(runtime, request, prompt_ids, max_tokens, cancelled, assemblers):
    """Yield (choice index, text delta) as the choices are generated, a token of each in turn;
    `assemblers[i]` keeps choice i's whole text and finish reason. One choice decodes alone; `n`
    of them share one prefill (`generate_choices`), each with its own seed and controls."""
    controls = [Controls.of(request, runtime) for _ in assemblers]
    if len(assemblers) == 1:
        streams = [runtime.generate(prompt_ids, max_tokens, request.temperature, request.top_p, request.seed, cancelled,
                                    controls[0])]
    else:
        streams = runtime.generate_choices(prompt_ids, max_tokens, request.temperature, request.top_p,
                                           choice_seeds(request.seed, len(assemblers)), cancelled, controls)
    live = dict(enumerate(streams))
    try:
        while live:
            for index, tokens in list(live.items()):
                assembler = assemblers[index]
                token = next(tokens, None)
                if token is not None and not token.finished_by_eos:
                    delta = assembler.add(token.token_id, token.logprobs)
                    if delta:
                        yield index, delta
                    if not assembler.stopped:
                        continue
                if token is not None:  # EOS or a stop sequence
                    assembler.finish_reason = "stop"
                live.pop(index).close()  # a stop sequence ends the sequence now, not when collected
                rest = assembler.finish()
                if rest:
                    yield index, rest
    finally:
        for tokens in live.values():
            tokens.close()


def _usage(prompt_tokens, completion_tokens):
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


class TextAssembler:
    """Turns sampled tokens into text deltas that are safe to send.

    Holds back a trailing partial UTF-8 character and any tail that could still become a stop
    sequence, so a streamed answer never shows text that the final answer does not contain.
    """

    def __init__(self, runtime, stops):
        self.runtime = runtime
        self.stops = [stop for stop in stops if stop]
        self.token_ids = []
        # (token index, where its text begins, its logprob, its top ones) of each token asked for, in the answer
        self.logprobs = []
        self._logprobs_sent = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.finish_reason = "length"

    @property
    def produced(self):
        return len(self.token_ids)

    def add(self, token_id, logprobs=None):
        self.token_ids.append(token_id)
        if logprobs is not None:  # its text begins where the text of the tokens before it ended
            self.logprobs.append((len(self.token_ids) - 1, len(self.text), *logprobs))
        full = self.runtime.decode(self.token_ids)
        cut = self._stop_index(full)
        if cut is not None:
            self.text, self.stopped = full[:cut], True
            self._drop_logprobs_after(cut)
            return self._emit(cut)
        self.text = full
        safe = len(full.rstrip("\ufffd"))
        safe -= self._held_tail(full[:safe])
        return self._emit(safe)

    def finish(self):
        if not self.stopped:
            self.text = self.text.rstrip("\ufffd") if self.text.endswith("\ufffd") else self.text
        return self._emit(len(self.text))

    def _emit(self, upto):
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta

    def _drop_logprobs_after(self, cut):
        """A stop sequence cut the text: tokens whose text lies wholly past the cut are not in
        the answer, nor are their logprobs."""
        while self.logprobs and self.logprobs[-1][1] >= cut:
            self.logprobs.pop()

    def take_logprobs(self):
        """The logprobs not yet sent (a stream's chunk carries those of the tokens since the last)."""
        taken = self.logprobs[self._logprobs_sent:]
        self._logprobs_sent = len(self.logprobs)
        return taken

    def _stop_index(self, full):
        found = [full.find(stop, max(0, self.emitted - len(stop))) for stop in self.stops]
        found = [index for index in found if index >= 0]
        return min(found) if found else None

    def _held_tail(self, text):
        held = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held
