"""The sampling controls of one sequence (issue 29, point 4): `logit_bias` and the presence and
frequency penalties, applied to a row's logits before it is sampled, wherever it decodes (the
resident model's own loop, the step scheduler's shared steps).

As OpenAI defines them, for each token j with c[j] occurrences among the sequence's own generated
tokens (the prompt does not count):

    logits[j] += bias[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty

A `response_format` other than text, or a forced tool call (inference_app/tools.py), adds the sequence's grammar state (grammars.py): its mask
goes last, so a bias never lets a token through that the grammar forbids.

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
        if not bias and not presence and not frequency and grammar is None:
            return None
        return cls(bias, presence, frequency, grammar)

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
    """One token for a row: its controls (if any) applied, then the runtime's sampling rule."""
    if controls is None:
        return runtime._sample(logits, temperature, top_p, generator)
    token_id = runtime._sample(controls.apply(logits, produced), temperature, top_p, generator)
    controls.accept(token_id)
    return token_id
