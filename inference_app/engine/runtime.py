"""The resident model: tokenisation, chat rendering and the forward passes the services need.

Every method that touches weights runs in the engine's model thread, under the admission slot.
"""

import copy
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from django.conf import settings

from inference_app import chat_templates
from inference_app.engine import attention, compiled, decoding, lean_step, quantized
from inference_app.engine.prefix_cache import PrefixCache
from inference_app.engine.controls import sample
from inference_app.engine.loader import LoadedModel
from inference_app import tools as chat_tools
from inference_app.provenance import system_fingerprint

log = logging.getLogger("millm.engine")


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    finished_by_eos: bool
    logprobs: tuple | None = None  # (its logprob, [(token id, logprob)] top ones) when asked (controls.py)


class ResidentModel:
    def __init__(self, loaded: LoadedModel, model_id=None):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.model_id = model_id or loaded.source.model_id
        config = self.model.config
        self.context_length = int(getattr(config, "max_position_embeddings", None) or 2048)
        self.vocab_size = int(config.vocab_size)
        self.chat_template = loaded.chat_template
        self.eos_ids = _eos_ids(self.model, self.tokenizer) | chat_templates.turn_end_ids(self.tokenizer, self.chat_template)
        # Whether generation sequences can share decode steps, and the start-up line's words for it.
        self.batches, self.decoding = decoding.batches(self.model.config)
        log.info("decoding %s: %s", self.model_id, self.decoding)
        self.serve(self.model)
        self.fingerprint = self._fingerprint()
        # Shared prefixes' keys and values (prefix_cache.py): this model's own, dropped with it.
        self.prefix_cache = PrefixCache(settings.MILLM_PREFIX_CACHE_MB * 2**20)
        if settings.MILLM_COMPILE == "decode":
            self.compile_decode_step()

    def serve(self, model):
        """Decode with `model` (at load; bench/cpu_levers.py swaps in a lever's copy). Its eager
        step, which both loops' steps run: the lean step where it reproduces the model's forward
        pass to the bit (lean_step.py: Llama's and Gemma 3's layers), else the model itself."""
        self.model = model
        self.eager_step, self.step_words = lean_step.eager_step(model)
        log.info("decode steps for %s: %s", self.model_id, self.step_words)
        # What the scheduler's decode steps call: the eager step, or the model's compiled forward.
        self.decode_forward = self.eager_step

    def compile_decode_step(self, backend="inductor"):
        """MILLM_COMPILE=decode: compile the decode step's two shape buckets now (compiled.py)."""
        self.decode_forward = compiled.CompiledStep(self.model, backend)
        self.decode_forward.warm(self)
        self.refresh_fingerprint()

    def rename(self, model_id, revision):
        """A save made these weights a checkpoint: the id and fingerprint they answer under change."""
        self.model_id = model_id
        self.loaded.revision = revision
        self.refresh_fingerprint()

    def refresh_fingerprint(self):
        """After a rename or an edit that ran a packed projection dense."""
        self.fingerprint = self._fingerprint()

    def weights_changed(self):
        """A weight edit wrote tensors: no cached prefix holds these weights' keys and values,
        and the fingerprint may change (the edit may have unpacked the last packed projection)."""
        self.prefix_cache.clear()
        self.refresh_fingerprint()

    def _fingerprint(self):
        loaded = self.loaded
        return system_fingerprint(self.model_id, loaded.revision, self.dtype_name, loaded.source.quantization,
                                  self.weights_form, compiled=self.compiled)

    @property
    def compiled(self):
        """Whether the scheduler's decode steps run the compiled forward (MILLM_COMPILE=decode)."""
        return self.decode_forward is not self.eager_step

    @property
    def weights_form(self):
        """"packed" while any projection runs from its packed blocks (an edit may have unpacked
        them all), else "dense"."""
        return "packed" if quantized.packed_modules(self.model) else "dense"

    @property
    def dtype_name(self):
        return attention.dtype_name(self.dtype)

    # --- text <-> tokens ---

    def encode(self, text):
        """The one tokenisation of a prompt, shared by chat (after rendering) and completions,
        so chat scoring equals completions scoring of the rendered prompt to the bit. A text that
        begins with the BOS token's text (a template that writes it, as Gemma's and Llama 3's do)
        gets no second one: a doubled BOS is a prompt the model never saw in training."""
        bos = self.tokenizer.bos_token
        written = bool(bos) and text.startswith(bos)
        return self.tokenizer(text, add_special_tokens=not written)["input_ids"]

    def render_chat(self, messages, tools=()):
        """The prompt of a conversation, with `tools` (function tools) shown to the model: by the
        chat template when it reads them, else in the system message (inference_app/tools.py).
        A model with no template refuses (400 naming MILLM_CHAT_TEMPLATE)."""
        if not self.chat_template.present:
            raise chat_templates.missing(self.model_id)
        native = bool(tools) and "tools" in str(self.tokenizer.chat_template or "")
        conversation = chat_tools.conversation(messages, tools, native)
        add_generation_prompt = messages[-1].role != "assistant"
        extra = {"tools": [chat_tools.template_tool(tool) for tool in tools]} if native else {}
        return self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )

    def decode(self, token_ids):
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_string(self, token_id):
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id):
        return list(self.token_string(token_id).encode("utf-8"))

    def is_eos(self, token_id):
        return token_id in self.eos_ids

    # --- forward passes ---

    @torch.inference_mode()
    def last_logits(self, token_ids):
        """Logits at the prompt's last token only: the head runs at one position, not all."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, temperature, top_p, seed, cancelled=lambda: False, controls=None):
        """Yield sampled token ids one at a time, with a KV cache; stops at EOS or the limit.
        `controls`: the sequence's sampling controls (controls.Controls), or None."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        yield from self._decode(out, max_new_tokens, temperature, top_p, seed, cancelled, controls)

    @torch.inference_mode()
    def generate_choices(self, prompt_ids, max_new_tokens, temperature, top_p, seeds, cancelled=lambda: False,
                         controls=()):
        """A token iterator per seed (a request's `n` choices), all from one prefill: each choice
        decodes from its own copy of the prompt's cache. `controls`: one per choice (or None)."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        copies = [out] + [copy.deepcopy(out) for _ in seeds[1:]]
        return [self._decode(prefilled, max_new_tokens, temperature, top_p, seed, cancelled, choice_controls)
                for prefilled, seed, choice_controls in zip(copies, seeds, controls or [None] * len(seeds))]

    @torch.inference_mode()
    def _decode(self, out, max_new_tokens, temperature, top_p, seed, cancelled, controls):
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        produced = []
        for _ in range(max_new_tokens):
            if cancelled():
                return
            token_id, logprobs = sample(self, out.logits[0, -1].float(), temperature, top_p, generator, controls,
                                        produced)
            produced.append(token_id)
            eos = self.is_eos(token_id)
            yield SampledToken(token_id, eos, logprobs)
            if eos or len(produced) == max_new_tokens:  # no step for a token nobody will sample
                return
            step = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
            out = self.eager_step(input_ids=step, cache=out.cache, use_cache=True, logits_to_keep=1)

    @staticmethod
    def _sample(logits, temperature, top_p, generator):
        if temperature == 0 or top_p == 0:
            return int(torch.argmax(logits))
        # Shifted by the largest first, so a tiny temperature (1e-300 is valid, 0 as a float32)
        # sends every other logit to -inf rather than the softmax to NaN (inf - inf), and the
        # largest's own 0 / 0 is 0: the limit of a vanishing temperature, the largest logit(s).
        shifted = logits - logits.max()
        probs = torch.softmax(torch.where(shifted == 0, 0.0, shifted / temperature), dim=-1)
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            keep = cumulative - sorted_probs < top_p
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            choice = torch.multinomial(sorted_probs, 1, generator=generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=generator))

    def _right_padded(self, sequences, prefix=None):
        """One right-padded forward pass over `sequences`; with `prefix` (a CachedPrefix every
        sequence begins with), over what follows it only, the prefix's keys and values in the
        cache. Returns the hidden states, each sequence's own length (after the prefix) and the
        padding mask."""
        start = 0 if prefix is None else len(prefix.tokens)
        sequences = [sequence[start:] for sequence in sequences]
        lengths = torch.tensor([len(ids) for ids in sequences], device=self.device)
        width = int(lengths.max())
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(sequences), width), pad, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(sequences), width), dtype=torch.long, device=self.device)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long, device=self.device)
            mask[row, : len(sequence)] = 1
        # Right padding: real tokens keep positions 0..n-1 (after a prefix, its length onwards) and
        # never attend to padding, which only ever follows them.
        if prefix is None:
            hidden = self.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        else:
            seen = torch.ones((len(sequences), start), dtype=torch.long, device=self.device)
            hidden = self.model.base_model(input_ids=ids, attention_mask=torch.cat([seen, mask], dim=1),
                                           cache=prefix.as_cache(len(sequences)), use_cache=True).last_hidden_state
        return hidden, lengths, mask

    @torch.inference_mode()
    def packed_last_logits(self, sequences, prefix=None):
        """Logits at each sequence's own last real token, from one right-padded forward pass
        (after `prefix`, a CachedPrefix they all begin with, when given).

        The head runs only at the gathered positions, never over the whole pack.
        """
        hidden, lengths, _ = self._right_padded(sequences, prefix)
        gathered = hidden[torch.arange(len(sequences), device=self.device), lengths - 1]
        return list(self.model.get_output_embeddings()(gathered).float())

    @torch.inference_mode()
    def packed_embed(self, sequences, pooling, normalize, prefix=None):
        """Each sequence pooled over its own tokens (by the attention mask), as float32. A
        `prefix` (the sequences' shared CachedPrefix) only with `last` pooling, which reads one
        token after it."""
        if prefix is not None and pooling != "last":
            raise ValueError(f"{pooling} pooling reads the prefix's own hidden states")
        hidden, lengths, mask = self._right_padded(sequences, prefix)
        hidden = hidden.float()
        if pooling == "mean":
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            vectors = (hidden * weights).sum(dim=1) / lengths.unsqueeze(-1).to(hidden.dtype)
        elif pooling == "last":
            vectors = hidden[torch.arange(len(sequences), device=self.device), lengths - 1]
        else:
            vectors = hidden[:, 0]
        if normalize:
            vectors = F.normalize(vectors, p=2, dim=-1)
        return list(vectors.cpu())

    @property
    def num_layers(self):
        return int(self.model.config.num_hidden_layers)

    @property
    def hidden_size(self):
        return int(self.model.config.hidden_size)

    @torch.inference_mode()
    def hidden_states(self, token_ids):
        """transformers' hidden_states for one unpadded input: [embeddings, block 0, ..., block n-1]."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        return self.model.base_model(input_ids=ids, output_hidden_states=True).hidden_states

    @torch.inference_mode()
    def embed(self, token_ids, pooling, normalize):
        """The last hidden layer pooled over the input's own tokens, as float32."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        hidden = self.model.base_model(input_ids=ids).last_hidden_state[0].float()
        if pooling == "mean":
            vector = hidden.mean(dim=0)
        elif pooling == "last":
            vector = hidden[-1]
        else:
            vector = hidden[0]
        if normalize:
            vector = F.normalize(vector, p=2, dim=0)
        return vector.cpu()


def _eos_ids(model, tokenizer):
    ids = set()
    for candidate in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(candidate, int):
            ids.add(candidate)
        elif isinstance(candidate, (list, tuple)):
            ids.update(int(item) for item in candidate)
    return frozenset(ids)
