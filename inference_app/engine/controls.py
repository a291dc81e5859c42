"""The sampling controls of one sequence (issue 29, point 4): `logit_bias` and the presence and
frequency penalties, applied to a row's logits before it is sampled, wherever it decodes (the
resident model's own loop, the step scheduler's shared steps).

As OpenAI defines them, for each token j with c[j] occurrences among the sequence's own generated
tokens (the prompt does not count):

    logits[j] += bias[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty

A `response_format` other than text, or a forced tool call (inference_app/tools.py), adds the sequence's grammar state (grammars.py): its mask
goes last, so a bias never lets a token through that the grammar forbids.

Logprobs on generated tokens (chat `logprobs: true` with `top_logprobs`, completions `logprobs`,
beyond scoring mode's one token) ride here too: `top_logprobs` (0-20) asks each sampled token for
its logprob and the most likely tokens', from the model's own distribution at that step (the raw
logits: before temperature, bias, penalties and grammar, as vLLM reports them), so a greedy token
is its step's top logprob.

A sequence that sets none of them has no Controls (None) and pays nothing.
"""

from dataclasses import dataclass, field

import torch

from inference_app.engine import grammars
from inference_app.tools import decoding_format


@dataclass(frozen=True)
class Controls:
    bias: tuple  # ((token id, value), ...)
    presence: float = 0.0
    frequency: float = 0.0
    grammar: grammars.GrammarState | None = None  # this sequence's own, or None
    top_logprobs: int | None = None  # each sampled token's logprob and this many top ones; None: not asked
    bias_ids: torch.Tensor = field(init=False, repr=False, compare=False)  # built once, not every token
    bias_values: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "bias_ids", torch.tensor([token for token, _ in self.bias], dtype=torch.long))
        object.__setattr__(self, "bias_values", torch.tensor([value for _, value in self.bias]))

    @classmethod
    def of(cls, request, runtime=None):
        """The request's controls for one sequence, or None when it sets none (or only neutral
        values). `runtime`: the model a grammar is built for (a constrained request needs it)."""
        bias = tuple(sorted((int(token), float(value)) for token, value in (request.logit_bias or {}).items() if value))
        presence = float(request.presence_penalty or 0)
        frequency = float(request.frequency_penalty or 0)
        grammar = grammars.state_for(runtime, decoding_format(request)[0]) if runtime is not None else None
        top_logprobs = request.generated_logprobs()
        if not bias and not presence and not frequency and grammar is None and top_logprobs is None:
            return None
        return cls(bias, presence, frequency, grammar, top_logprobs)

    @property
    def shapes_logits(self):
        return bool(self.bias or self.presence or self.frequency or self.grammar is not None)

    def apply(self, logits, produced):
        """`logits` (one row, float) adjusted for a sequence that has generated `produced`: a new
        tensor; the caller's row (a view of a shared step's logits) is left as it was."""
        logits = logits.clone()
        if self.bias:
            logits[self.bias_ids.to(logits.device)] += self.bias_values.to(logits.device, logits.dtype)
        if produced and (self.presence or self.frequency):
            ids, counts = torch.unique(torch.tensor(produced, device=logits.device), return_counts=True)
            logits[ids] -= counts.to(logits.dtype) * self.frequency + self.presence
        if self.grammar is not None:
            self.grammar.mask(logits)
        return logits

    def accept(self, token_id):
        if self.grammar is not None:
            self.grammar.accept(token_id)


def sample(runtime, logits, temperature, top_p, generator, controls, produced):
    """One token for a row, its controls (if any) applied, then the runtime's sampling rule:
    (its id, its logprobs entry when the controls ask for one, else None)."""
    if controls is None:
        return runtime._sample(logits, temperature, top_p, generator), None
    shaped = controls.apply(logits, produced) if controls.shapes_logits else logits
    token_id = runtime._sample(shaped, temperature, top_p, generator)
    controls.accept(token_id)
    if controls.top_logprobs is None:
        return token_id, None
    return token_id, token_logprobs(logits, token_id, controls.top_logprobs)


def token_logprobs(logits, token_id, count):
    """(the token's logprob, [(token id, logprob)] of the `count` most likely) under the model's
    own distribution at this step (float32 log-softmax of the raw logits)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, count) if count else None
    listed = [] if top is None else [(int(index), float(value)) for value, index in zip(top.values, top.indices)]
    return float(logprobs[token_id]), listed
