"""Grammars enforced while decoding (issue 29, point 1), with llguidance (as vLLM uses it): a
`response_format` becomes a grammar once per distinct schema (cached by its hash), and each
sequence that follows it gets a matcher of its own, whose mask leaves only the tokens that keep
the answer valid. There is no whitespace between tokens (`,` and `:` alone), so a finite schema
ends within its own length even on a random model. Once the answer is complete the mask allows
only the end of sequence.

The tokenizer's llguidance form is built once per resident tokenizer.
"""

import functools
import json
import weakref

import llguidance
import llguidance.hf
import torch

from inference_app.structured import grammar_kind, grammar_sha, schema_of
from millm_lib.errors import invalid_value

JSON_OPTIONS = {"whitespace_flexible": False}
# Bit i of a mask word is token 32 * word + i; read a byte at a time (x86 and ARM are little-endian,
# so byte b of word w holds tokens 32w + 8b to 32w + 8b + 7): row j of this table is byte j's 8 bits.
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
_tokenizers = weakref.WeakKeyDictionary()  # a Hugging Face tokenizer -> its llguidance form


def tokenizer_of(runtime):
    tokenizer = runtime.tokenizer
    if tokenizer not in _tokenizers:
        converted = llguidance.hf.from_tokenizer(tokenizer, n_vocab=runtime.vocab_size, eos_token=sorted(runtime.eos_ids))
        # The first mask of a tokenizer builds llguidance's token tables (1.6 s for SmolLM2's 49,152
        # tokens on a 2-core EPYC): paid here, once, not by the first constrained token.
        warm = llguidance.LLMatcher(converted, _grammar("warm", "json_object", '{"type": "object"}'))
        _fill(warm, _bitmask(runtime.vocab_size))
        _tokenizers[tokenizer] = converted
    return _tokenizers[tokenizer]


def _bitmask(vocab_size):
    """One row of mask words, 32 tokens to a word (llguidance's layout)."""
    return torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)


def _fill(matcher, bitmask):
    """The matcher's next-token mask written into `bitmask`. This is all
    `llguidance.torch.fill_next_token_bitmask` does; that module is not imported because it
    imports torch's compiler (3.4 s at every engine start) for a kernel this module does not use."""
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())


@functools.lru_cache(maxsize=512)
def _grammar(sha, kind, schema_text):
    return llguidance.LLMatcher.grammar_from_json_schema(json.loads(schema_text), defaults=JSON_OPTIONS)


def compile_grammar(runtime, response_format, param="response_format"):
    """The grammar of `response_format` (cached by its hash), checked against the tokenizer; a
    schema llguidance cannot enforce is 400 naming its reason."""
    kind = grammar_kind(response_format)
    try:
        grammar = _grammar(grammar_sha(response_format), kind, json.dumps(schema_of(response_format)))
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer_of(runtime))
    except Exception as error:  # noqa: BLE001 - whatever llguidance raises on a schema it cannot read is the schema's fault
        problem = str(error)
    if problem:
        reason = " ".join(problem.split())[:300]  # llguidance's report spans lines
        raise invalid_value(param, f"the grammar cannot be built: {reason}")
    return grammar


class GrammarState:
    """One sequence's place in its grammar: `mask(logits)` leaves the tokens it may take next,
    `accept(token_id)` moves on."""

    def __init__(self, runtime, grammar, sha, kind):
        self.matcher = llguidance.LLMatcher(tokenizer_of(runtime), grammar)
        self.bitmask = _bitmask(runtime.vocab_size)
        self.sha, self.kind = sha, kind

    def mask(self, logits):
        """`logits` (one row) with every token the grammar forbids at -inf, in place. The bits are
        unpacked here: llguidance's own torch kernel is a torch.compile'd function that took
        28 ms a row on this CPU (and compiles at its first call), against 0.1 ms here."""
        _fill(self.matcher, self.bitmask)
        allowed = _BYTE_BITS[self.bitmask.view(torch.uint8).long()].flatten()[: logits.shape[-1]]
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
        return logits

    def accept(self, token_id):
        self.matcher.consume_token(token_id)


def state_for(runtime, response_format):
    """A fresh GrammarState for a request's `response_format`, or None for text."""
    kind = grammar_kind(response_format)
    if kind is None:
        return None
    return GrammarState(runtime, compile_grammar(runtime, response_format), grammar_sha(response_format), kind)
