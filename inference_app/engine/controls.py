"""The sampling controls of one sequence (issue 29, point 4): `logit_bias` and the presence and
frequency penalties, applied to a row's logits before it is sampled, wherever it decodes (the
resident model's own loop, the step scheduler's shared steps).

As OpenAI defines them, for each token j with c[j] occurrences among the sequence's own generated
tokens (the prompt does not count):

    logits[j] += bias[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty

A sequence that sets none of them has no Controls (None) and pays nothing.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Controls:
    bias: tuple  # ((token id, value), ...)
    presence: float = 0.0
    frequency: float = 0.0

    @classmethod
    def of(cls, request):
        """The request's controls, or None when it sets none (or only neutral values)."""
        bias = tuple(sorted((int(token), float(value)) for token, value in (request.logit_bias or {}).items() if value))
        presence = float(request.presence_penalty or 0)
        frequency = float(request.frequency_penalty or 0)
        if not bias and not presence and not frequency:
            return None
        return cls(bias, presence, frequency)

    def apply(self, logits, produced):
        """`logits` (one row, float) adjusted for a sequence that has generated `produced`: a new
        tensor; the caller's row (a view of a shared step's logits) is left as it was."""
        logits = logits.clone()
        if self.bias:
            ids = torch.tensor([token for token, _ in self.bias], device=logits.device)
            logits[ids] += torch.tensor([value for _, value in self.bias], dtype=logits.dtype, device=logits.device)
        if produced and (self.presence or self.frequency):
            ids, counts = torch.unique(torch.tensor(produced, device=logits.device), return_counts=True)
            logits[ids] -= counts.to(logits.dtype) * self.frequency + self.presence
        return logits


def sample(runtime, logits, temperature, top_p, generator, controls, produced):
    """One token for a row: its controls (if any) applied, then the runtime's sampling rule."""
    if controls is not None:
        logits = controls.apply(logits, produced)
    return runtime._sample(logits, temperature, top_p, generator)
