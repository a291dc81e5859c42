"""The step scheduler: generation sequences decoded together, one forward pass per step.

A `Sequence` is a plain state object (prompt, sampling parameters, its own generator, the tokens
made so far). Whoever holds a seat (admission.py decides who may) submits it; the scheduler's
one thread ("decode") owns every forward pass of every live sequence:

1. At a step boundary, waiting sequences join (interactive first), each prefilled alone, within
   a budget of prompt tokens per step (at least one joins); its first token comes from its own
   prefill.
2. One forward pass for every live sequence; each row is sampled with its sequence's own
   generator, so a seeded request gives the same tokens alone or among others.
3. Each token goes to its sequence's queue; a sequence leaves at EOS, its max_new_tokens, its
   caller's cancel, or when its consumer closes it (a stop sequence, a client that left).

The consumer (a service function, in a thread of its own) reads tokens from the queue through
`SeatedRuntime.generate`, the same interface as `ResidentModel.generate`. Closing a sequence
waits until the scheduler has dropped it, so a released seat never has a forward pass in flight.
"""

import logging
import os
import queue
import threading
from collections import deque

import torch

from inference_app.engine.decoding import BatchedDecoder
from inference_app.engine.runtime import SampledToken
from inference_app.errors import ApiError

log = logging.getLogger("millm.engine")

_END = object()


class Sequence:
    def __init__(self, runtime, prompt_ids, max_new_tokens, temperature, top_p, seed, cancelled, interactive):
        self.runtime = runtime
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.cancelled = cancelled
        self.interactive = interactive
        self.generator = torch.Generator(device=runtime.device)
        self.generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        self.produced = []
        self.shared = False  # any decode step ran with another sequence in the same forward pass
        self.shared_at_first_token = False
        self.closed = threading.Event()  # the consumer wants no more tokens
        self.released = threading.Event()  # the scheduler dropped it: no forward pass of it is in flight
        self._tokens = queue.SimpleQueue()

    @property
    def context_ids(self):
        """What a (re)admission prefills: the prompt and every token made so far (a sequence
        sent back to wait after an out-of-memory joins again from here)."""
        return self.prompt_ids + self.produced

    def next_token(self):
        """The next SampledToken, or None once the sequence has ended; re-raises a step's failure."""
        item = self._tokens.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        self.closed.set()
        self.released.wait()

    @property
    def done(self):
        last = self.produced[-1] if self.produced else None
        return (
            self.closed.is_set()
            or self.cancelled()
            or len(self.produced) >= self.max_new_tokens
            or (last is not None and self.runtime.is_eos(last))
        )

    def _emit(self, token_id):
        self.produced.append(token_id)
        self._tokens.put(SampledToken(token_id, self.runtime.is_eos(token_id)))

    def _end(self, failure=None):
        self._tokens.put(failure if failure is not None else _END)
        self.released.set()


class StepScheduler:
    def __init__(self, prefill_tokens_per_step):
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.live = []
        self.decoder = None
        self.decoder_class = BatchedDecoder
        self.capacity = None  # live sequences at most, once the device ran out of memory
        self.steps = 0
        self._waiting = deque()
        self._condition = threading.Condition()
        self._thread = None

    @property
    def live_count(self):
        return len(self.live)

    def submit(self, sequence):
        with self._condition:
            if sequence.interactive:
                # Ahead of waiting batch rows, behind earlier interactive ones.
                position = sum(1 for waiting in self._waiting if waiting.interactive)
                self._waiting.insert(position, sequence)
            else:
                self._waiting.append(sequence)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="decode", daemon=True)
                self._thread.start()
            self._condition.notify()

    def _loop(self):
        while True:
            with self._condition:
                while not self._waiting and not self.live:
                    self._condition.wait()
                joining = self._joining()
            for sequence in joining:
                self._admit_or_requeue(sequence)
            self._drop_finished()
            if not self.live:
                continue
            try:
                self._step()
            except torch.OutOfMemoryError:
                self._shrink()
            except Exception as error:
                log.exception("a decode step failed; its %d sequence(s) end with an error", len(self.live))
                for sequence in self.live:
                    sequence._end(error)
                self.live, self.decoder = [], None
            self._drop_finished()

    def _joining(self):
        """Waiting sequences that join at this step boundary, under the prefill token budget
        and, after an out-of-memory, the room the device showed it has."""
        joining, budget = [], self.prefill_tokens_per_step
        room = (self.capacity or float("inf")) - len(self.live)
        if self.live and not self._merges:
            return joining  # this model decodes one sequence at a time
        while self._waiting and len(joining) < room:
            sequence = self._waiting[0]
            if sequence.closed.is_set():
                self._waiting.popleft()._end()
                continue
            if joining and len(sequence.context_ids) > budget:
                break
            joining.append(self._waiting.popleft())
            budget -= len(sequence.context_ids)
        return joining

    def _admit_or_requeue(self, sequence):
        """Admit; out of device memory, wait for room (or, with nothing else decoding, end with
        a 503: it does not fit even alone); any other failure ends this sequence alone."""
        try:
            self._admit(sequence)
        except torch.OutOfMemoryError:
            _free_device_memory()
            if not self.live:
                sequence._end(does_not_fit(len(sequence.context_ids)))
                return
            log.warning("out of device memory admitting a sequence: at most %d decode together for now", len(self.live))
            self.capacity = len(self.live)
            self._requeue([sequence])
        except Exception as error:
            log.exception("a sequence could not join the decode")
            sequence._end(error)

    def _shrink(self):
        """Out of device memory in a step: the newer half of the live sequences go back to wait
        (each joins again later from its prompt and the tokens it made so far), and no more than
        the rest decode together until the batch empties."""
        _free_device_memory()
        if len(self.live) == 1:
            self.live[0]._end(does_not_fit(len(self.live[0].context_ids)))
            self.live, self.decoder = [], None
            return
        keep = len(self.live) // 2
        log.warning("out of device memory in a step of %d sequences: %d go back to wait", len(self.live),
                    len(self.live) - keep)
        preempted = self.live[keep:]
        self.decoder.drop(list(range(keep, len(self.live))))
        self.live, self.capacity = self.live[:keep], keep
        self._requeue(preempted)

    def _requeue(self, sequences):
        with self._condition:
            self._waiting.extendleft(reversed(sequences))

    @property
    def _merges(self):
        return self.decoder is None or self.decoder.merges is not False

    def _admit(self, sequence):
        """Prefill alone, merge into the batch, sample the first token; a sequence of a model
        whose cache cannot merge goes back to wait while another one decodes."""
        if not self.live and (self.decoder is None or self.decoder.runtime is not sequence.runtime):
            self.decoder = self.decoder_class(sequence.runtime)
        if self.live and not self._merges:
            self._requeue([sequence])
            return
        context = sequence.context_ids
        cache, logits = self.decoder.prefill(context)
        self.decoder.merges = BatchedDecoder.mergeable(cache)
        if self.live and not self.decoder.merges:
            self._requeue([sequence])
            return
        self.decoder.admit(cache, len(context))
        self.live.append(sequence)
        if not sequence.produced:
            sequence.shared_at_first_token = len(self.live) > 1
        self._sample(sequence, logits)

    def _step(self):
        logits = self.decoder.step([sequence.produced[-1] for sequence in self.live])
        self.steps += 1
        shared = len(self.live) > 1
        for row, sequence in enumerate(self.live):
            sequence.shared = sequence.shared or shared
            self._sample(sequence, logits[row])

    def _sample(self, sequence, logits):
        token_id = sequence.runtime._sample(logits, sequence.temperature, sequence.top_p, sequence.generator)
        sequence._emit(token_id)

    def _drop_finished(self):
        finished = [row for row, sequence in enumerate(self.live) if sequence.done]
        if not finished:
            return
        self.decoder.drop(finished)
        for row in finished:
            self.live[row]._end()
        self.live = [sequence for row, sequence in enumerate(self.live) if row not in set(finished)]
        if not self.live:
            self.capacity = None  # the device has all its memory back: try full width again


def does_not_fit(tokens):
    return ApiError(
        503, "out_of_memory",
        f"A sequence of {tokens} tokens does not fit in the device's memory even decoding alone; "
        "retry later or send a shorter prompt or max_tokens",
        retry_after=5,
    )


def _free_device_memory():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class SeatedRuntime:
    """The resident model as a seated request sees it: `generate` decodes through the scheduler,
    everything else is the resident model's own. Remembers whether any of its sequences shared
    a step (the request's X-miLLM-Backend)."""

    def __init__(self, runtime, scheduler, interactive, stopped=lambda: False):
        """`stopped()`: true once the seat's holder gave up (its sequences end at the next step)."""
        self._runtime = runtime
        self._scheduler = scheduler
        self._interactive = interactive
        self._stopped = stopped
        self.sequences = []

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    @property
    def shared(self):
        return any(sequence.shared for sequence in self.sequences)

    @property
    def shared_at_first_token(self):
        return any(sequence.shared_at_first_token for sequence in self.sequences)

    def generate(self, prompt_ids, max_new_tokens, temperature, top_p, seed, cancelled=lambda: False):
        stopped = self._stopped
        sequence = Sequence(
            self._runtime, prompt_ids, max_new_tokens, temperature, top_p, seed,
            lambda: cancelled() or stopped(), self._interactive,
        )
        if max_new_tokens <= 0:
            return
        self.sequences.append(sequence)
        self._scheduler.submit(sequence)
        try:
            while (token := sequence.next_token()) is not None:
                yield token
        finally:
            sequence.close()
