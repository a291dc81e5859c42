"""The step scheduler: generation sequences decoded together, one forward pass per step.

A `Sequence` is a plain state object (prompt, sampling parameters, its own generator, the tokens
made so far). Whoever holds a seat (admission.py decides who may) submits it; the scheduler's
thread owns every forward pass of every live sequence. That thread is the engine's model thread
(Seating's), the one that runs every other forward pass too: the scheduler drains its work there
(a task that steps until no sequence is live or waiting), so torch's OpenMP workers form one pool.
A second thread running parallel kernels gives OpenMP a second pool, more workers than cores on a
machine where torch uses every core, and every kernel got slower (most likely waiting for a
sleeping worker): one chat decoded at half speed (bench/FINDINGS.md, "One thread for every forward pass"). The steps:

1. At a step boundary, waiting sequences join (interactive first), within a budget of prompt
   tokens per step (at least one joins), each prefilled alone or, where the policy says so
   (ENGINE_PREFILL_TOGETHER), those that join together in one padded pass; a sequence's first
   token comes from its prefill.
2. One forward pass for every live sequence; each row is sampled with its sequence's own
   generator, so a seeded request gives the same tokens alone or among others.
3. Each token goes to its sequence's queue; a sequence leaves at EOS, its max_new_tokens, its
   caller's cancel, or when its consumer closes it (a stop sequence, a client that left).

The consumer (a service function, in a thread of its own) reads tokens from the queue through
`SeatedRuntime.generate`, the same interface as `ResidentModel.generate`. Closing a sequence
waits until the scheduler has dropped it, so a released seat never has a forward pass in flight.
"""

import copy
import logging
import os
import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from inference_app.engine import policy
from inference_app.engine.controls import sample
from inference_app.engine.decoding import BatchedDecoder
from inference_app.engine.runtime import SampledToken
from millm_lib.errors import ApiError

log = logging.getLogger("millm.engine")

_END = object()
_WAIT, _ENDED = object(), object()  # what an admission can come to besides the joiner's logits
_OUT_OF_MEMORY = object()
# The resident model's forward passes other than generation: a seated request must never run
# them beside the scheduler's steps (they take the whole model, through the slot).
_NOT_SEATED = frozenset({"last_logits", "packed_last_logits", "packed_embed", "embed", "hidden_states"})


class Sequence:
    def __init__(self, runtime, prompt_ids, max_new_tokens, temperature, top_p, seed, cancelled, interactive,
                 controls=None, prefill_key=None, reuse_prefix=False):
        self.runtime = runtime
        # Its prefill may begin from a cached prefix of its prompt (prefix_cache.py), and says how much did.
        self.reuse_prefix = reuse_prefix
        self.prefix_tokens_reused = 0
        # Sequences with the same key (a request's `n` choices) share one prefill when they join together.
        self.prefill_key = prefill_key
        self.controls = controls  # its sampling controls (controls.Controls), or None
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
        self.failure = None  # an error of this sequence alone (its sampling): it ends with it
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
    def abandoned(self):
        return self.closed.is_set() or self.cancelled() or self.failure is not None

    @property
    def done(self):
        last = self.produced[-1] if self.produced else None
        return (
            self.abandoned
            or len(self.produced) >= self.max_new_tokens
            or (last is not None and self.runtime.is_eos(last))
        )

    def _emit(self, token_id, logprobs=None):
        self.produced.append(token_id)
        self._tokens.put(SampledToken(token_id, self.runtime.is_eos(token_id), logprobs))

    def _end(self, failure=None):
        self._tokens.put(failure if failure is not None else _END)
        self.released.set()


class Lane:
    """Sequences that decode in the same forward passes, with their batched cache."""

    def __init__(self):
        self.live = []
        self.decoder = None
        self.capacity = None  # live sequences at most, once the device ran out of memory

    @property
    def merges(self):
        return self.decoder is None or self.decoder.merges is not False


class StepScheduler:
    """`batch_rows_beside_chats` (ENGINE_BATCH_ROWS_BESIDE_CHATS): "decode": batch rows and
    chats share one lane, every step runs them all; "pause": two lanes, and while a chat decodes
    only the chats' lane steps (batch rows keep their cache and resume when no chat is live):
    where a step of many rows costs several single steps (a CPU), a chat then decodes as fast as
    alone; "auto": pause on a CPU, decode on a GPU (where a wider step costs little more)."""

    def __init__(self, prefill_tokens_per_step, batch_rows_beside_chats="auto", thread=None, prefill_together="off"):
        """`thread`: the single-thread executor its steps run in (the engine's model thread);
        one of its own when none is given. `prefill_together`: ENGINE_PREFILL_TOGETHER."""
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.batch_rows_beside_chats = batch_rows_beside_chats
        self.prefill_together = prefill_together
        self.chats, self.rows = Lane(), Lane()
        self.decoder_class = BatchedDecoder
        self.steps = 0
        self._waiting = deque()
        self._condition = threading.Condition()
        self._thread = thread or ThreadPoolExecutor(1, thread_name_prefix="decode")
        self._draining = False  # a drain task is queued or running in the thread

    @property
    def live(self):
        return self.chats.live + self.rows.live

    def lane_of(self, sequence):
        if sequence.interactive:
            return self.chats
        mode = policy.lane_mode(self.batch_rows_beside_chats, sequence.runtime.device.type)
        return self.chats if mode == "decode" else self.rows

    def submit(self, *sequences):
        """Put sequences in line, together (a request's choices join at the same step boundary)."""
        with self._condition:
            for sequence in sequences:
                interactive_waiting = sum(1 for waiting in self._waiting if waiting.interactive)
                self._waiting.insert(
                    policy.place_in_line(interactive_waiting, len(self._waiting), sequence.interactive), sequence)
            if self._draining:
                return
            self._draining = True
        try:
            self._thread.submit(self._drain).add_done_callback(self._drain_done)
        except RuntimeError:  # the engine is stopping: its executor takes no more work
            self._end_waiting_for_a_stop()

    def _drain_done(self, drain):
        if drain.cancelled():  # the engine stopped before the drain ran: nothing is live yet
            self._end_waiting_for_a_stop()

    def _end_waiting_for_a_stop(self):
        with self._condition:
            self._draining = False
            waiting = list(self._waiting)
            self._waiting.clear()
        for sequence in waiting:
            sequence.failure = ApiError(503, "engine_unavailable", "The engine is stopping; retry", retry_after=5)
        self._end_abandoned(waiting)

    def _drain(self):
        """Steps until no sequence is live or waiting, in the model thread."""
        while True:
            with self._condition:
                if not self._waiting and not self.live:
                    # Nothing decodes: hold no reference to a model a swap unloads.
                    self.chats.decoder = self.rows.decoder = None
                    self._draining = False
                    return
            try:
                self._one_step()
            except Exception as error:  # never leave the drain: its consumers would wait for ever
                log.exception("a decode step failed; its %d sequence(s) end with an error", len(self.live))
                for lane in (self.chats, self.rows):
                    self._fail_live(lane, error)

    def _one_step(self):
        """1. End the sequences nobody wants any more (waiting or live, in either lane).
        2. Choose the lane: the chats' while any sequence of it decodes or waits (batch rows
           join the chats' lane when they decode beside chats), else the batch rows'.
        3. Admit its joiners. 4. One forward pass for every live sequence of the lane (out of
        device memory: all of them go back to wait, at most half as many together until the
        lane empties). 5. Drop the finished."""
        self._end_abandoned_waiters()
        for lane in (self.chats, self.rows):
            self._drop_finished(lane)
        lane = self.chats if self.chats.live or self._chat_waiting() else self.rows
        self._admit(lane, self._joining(lane))
        self._drop_finished(lane)
        if not lane.live:
            return
        try:
            self._step(lane)
            out_of_memory = False
        except torch.OutOfMemoryError:
            out_of_memory = True  # handled outside the except block, whose traceback holds the pass's memory
        if out_of_memory:
            self._shrink(lane)
        self._drop_finished(lane)

    def _end_abandoned_waiters(self):
        with self._condition:
            abandoned = [sequence for sequence in self._waiting if sequence.abandoned]
            for sequence in abandoned:
                self._waiting.remove(sequence)
        self._end_abandoned(abandoned)

    def _joining(self, lane):
        """The lane's waiting sequences that join at this step boundary, in order, under the
        prefill token budget and, after an out-of-memory, the room the device showed it has."""
        joining, budget = [], self.prefill_tokens_per_step
        room = (lane.capacity or float("inf")) - len(lane.live)
        if lane.live and not lane.merges:
            return joining  # this model decodes one sequence at a time
        with self._condition:
            for sequence in list(self._waiting):
                # A sibling of a joiner costs no prefill: it shares the joiner's.
                shared = sequence.prefill_key is not None and any(
                    joiner.prefill_key is sequence.prefill_key for joiner in joining)
                cost = 0 if shared else len(sequence.context_ids)
                if not policy.joins_this_step(len(joining), cost, budget, room):
                    break
                if self.lane_of(sequence) is lane:
                    self._waiting.remove(sequence)
                    joining.append(sequence)
                    budget -= cost
        return joining

    def _admit(self, lane, joining):
        """Prefill the joiners (each alone, or a run of them in one padded pass where
        `sharing_one_prefill` says so) and merge them; then, with everyone seated, sample each
        one's first token (so `shared_at_first_token` is known before the token is seen). A joiner
        that does not fit waits again (or, alone, ends with a 503); a model whose cache cannot
        merge takes one sequence at a time."""
        admitted, prefilled = [], {}  # prefilled: a prefill key -> (its cache, logits), for siblings
        index, together = 0, True
        while index < len(joining):
            if index and lane is not self.chats and self._chat_waiting():
                self._requeue(joining[index:])  # a chat came during the rows' prefills: it goes first
                break
            group = (sharing_one_prefill(joining[index:], self.prefill_together, self.prefill_tokens_per_step)
                     if together else [])
            if group:
                logits = self._prefill_together_and_merge(lane, group)
                if logits is not None:
                    admitted.extend(zip(group, logits))
                    index += len(group)
                    continue
                together = False  # out of memory together: each of them alone, as before
            sequence = joining[index]
            logits = self._prefill_and_merge(lane, sequence, prefilled)
            if logits is _WAIT:  # no room: it and the joiners after it wait
                self._requeue(joining[index:])
                break
            if logits is not _ENDED:
                admitted.append((sequence, logits))
            index += 1
        for sequence, logits in admitted:
            if not sequence.produced:
                sequence.shared_at_first_token = len(lane.live) > 1
            self._sample(sequence, logits)

    def _chat_waiting(self):
        with self._condition:
            return any(self.lane_of(waiting) is self.chats for waiting in self._waiting)

    def _prefill_together_and_merge(self, lane, group):
        """The group's logits, a row each, once they are rows of the lane; None when the padded
        pass ran out of device memory (the lane as it was: they prefill alone instead)."""
        decoder = self._decoder_for(lane, group[0].runtime)

        def prefill_and_admit():
            cache, mask, logits = decoder.prefill_together([sequence.context_ids for sequence in group])
            decoder.merges = BatchedDecoder.mergeable(cache)
            decoder.admit(cache, None, row_mask=mask)
            return logits

        logits = _unless_out_of_memory(prefill_and_admit)
        if logits is _OUT_OF_MEMORY:
            return None
        lane.live.extend(group)
        return list(logits)

    def _decoder_for(self, lane, runtime):
        """The lane's decoder: a new one for `runtime` when the lane is empty and has none for it."""
        if not lane.live and (lane.decoder is None or lane.decoder.runtime is not runtime):
            lane.decoder = self.decoder_class(runtime)
        return lane.decoder

    def _prefill_and_merge(self, lane, sequence, prefilled):
        """The joiner's logits once it is a row of the lane; _WAIT when it must wait, _ENDED
        when it cannot fit even alone. A sibling whose prompt was prefilled at this boundary
        takes a copy of that prefill's cache instead of running its own."""
        self._decoder_for(lane, sequence.runtime)
        if lane.live and not lane.merges:
            return _WAIT
        context = sequence.context_ids
        key = (sequence.prefill_key, tuple(context)) if sequence.prefill_key is not None else None

        def prefill_and_admit():
            if key in prefilled:
                cache, logits, sequence.prefix_tokens_reused = _copied(prefilled[key])
            else:
                if sequence.reuse_prefix:
                    cache, logits, sequence.prefix_tokens_reused = lane.decoder.prefill_reusing(
                        context, sequence.reuse_prefix)
                else:
                    cache, logits = lane.decoder.prefill(context)
                if key is not None:
                    # before the merge makes it the lane's
                    prefilled[key] = _copied((cache, logits, sequence.prefix_tokens_reused))
            lane.decoder.merges = BatchedDecoder.mergeable(cache)
            if lane.live and not lane.decoder.merges:
                return _WAIT
            lane.decoder.admit(cache, len(context))
            return logits

        logits = _unless_out_of_memory(prefill_and_admit)
        if logits is _WAIT:
            return _WAIT
        if logits is _OUT_OF_MEMORY:
            if not lane.live:
                sequence.failure = does_not_fit(len(context))
                self._end_abandoned([sequence])
                return _ENDED
            log.warning("out of device memory admitting a sequence: at most %d decode together for now", len(lane.live))
            lane.capacity = len(lane.live)
            return _WAIT
        lane.live.append(sequence)
        return logits

    def _shrink(self, lane):
        """Out of device memory in a step: the step may have grown some layers of the cache and
        not others, so the lane starts again: every live sequence waits again (each joins
        again from its prompt and the tokens it made so far), at most half as many together."""
        _free_device_memory()
        live, lane.live, lane.decoder = lane.live, [], None
        if len(live) == 1:
            live[0].failure = does_not_fit(len(live[0].context_ids))
            self._end_abandoned(live)
            return
        lane.capacity = max(1, len(live) // 2)
        log.warning("out of device memory in a step of %d sequences: at most %d decode together until the lane empties",
                    len(live), lane.capacity)
        self._requeue(live)

    def _requeue(self, sequences):
        with self._condition:
            self._waiting.extendleft(reversed(sequences))

    @staticmethod
    def _end_abandoned(sequences):
        for sequence in sequences:
            sequence._end(sequence.failure)

    @staticmethod
    def _fail_live(lane, error):
        live, lane.live, lane.decoder = lane.live, [], None
        for sequence in live:
            sequence._end(error)

    def _step(self, lane):
        logits = lane.decoder.step([sequence.produced[-1] for sequence in lane.live])
        self.steps += 1
        shared = len(lane.live) > 1
        for row, sequence in enumerate(lane.live):
            sequence.shared = sequence.shared or shared
            self._sample(sequence, logits[row])

    def _sample(self, sequence, logits):
        """Sample one row with the sequence's own generator; a failure ends this sequence alone."""
        try:
            token_id, logprobs = sample(sequence.runtime, logits, sequence.temperature, sequence.top_p,
                                        sequence.generator, sequence.controls, sequence.produced)
        except Exception as error:
            log.exception("sampling a sequence failed; it ends alone")
            sequence.failure = error
            return
        sequence._emit(token_id, logprobs)

    def _drop_finished(self, lane):
        finished = [row for row, sequence in enumerate(lane.live) if sequence.done]
        if not finished:
            return
        lane.decoder.drop(finished)
        ended = [lane.live[row] for row in finished]
        # Out of the lane before their ends are sent: a consumer that sees its end finds it gone.
        lane.live = [sequence for row, sequence in enumerate(lane.live) if row not in set(finished)]
        if not lane.live:
            lane.capacity = None  # the device has all its memory back: try full width again
        self._end_abandoned(ended)


def sharing_one_prefill(candidates, setting, budget):
    """The joiners from the first of `candidates` on that share one padded prefill: two or more,
    in order, each with a plain prefill (no cached prefix to begin from, no sibling sharing its
    prompt's pass) of a model whose cache merges as whole layers, where the policy says so
    (`setting`: ENGINE_PREFILL_TOGETHER), the padded pass within the prefill `budget`; [] when
    the first prefills alone."""
    first = candidates[0]
    if not (first.runtime.batches and policy.prefills_together(setting, first.runtime.dtype_name)):
        return []
    group, longest = [], 0
    for sequence in candidates:
        if sequence.runtime is not first.runtime or sequence.reuse_prefix or sequence.prefill_key is not None:
            break
        length = max(longest, len(sequence.context_ids))
        if not policy.fits_together(len(group) + 1, length, budget):
            break
        group.append(sequence)
        longest = length
    return group if len(group) > 1 else []


def _unless_out_of_memory(function):
    """`function()`, or _OUT_OF_MEMORY when the device ran out of memory in it (its memory freed:
    the failure's traceback, which holds the pass's tensors, is gone before the cache is emptied)."""
    try:
        return function()
    except torch.OutOfMemoryError:
        pass
    _free_device_memory()
    return _OUT_OF_MEMORY


@torch.inference_mode()
def _copied(prefill):
    return copy.deepcopy(prefill)


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

    def __init__(self, runtime, scheduler, interactive, stopped=lambda: False, reuse_prefix=False):
        """`stopped()`: true once the seat's holder gave up (its sequences end at the next step).
        `reuse_prefix`: its prefills may begin from a cached prefix (prefix_cache.py)."""
        self._runtime = runtime
        self._scheduler = scheduler
        self._interactive = interactive
        self._stopped = stopped
        self._reuse_prefix = reuse_prefix
        self.sequences = []

    def __getattr__(self, name):
        if name in _NOT_SEATED:
            raise AttributeError(f"{name} runs the whole model: a seated request only generates")
        return getattr(self._runtime, name)

    @property
    def shared(self):
        return any(sequence.shared for sequence in self.sequences)

    @property
    def shared_at_first_token(self):
        return any(sequence.shared_at_first_token for sequence in self.sequences)

    @property
    def prefix_tokens_reused(self):
        """The prompt's tokens a cached prefix held (its choices share one prompt)."""
        return max((sequence.prefix_tokens_reused for sequence in self.sequences), default=0)

    def generate(self, prompt_ids, max_new_tokens, temperature, top_p, seed, cancelled=lambda: False, controls=None):
        [tokens] = self.generate_choices(prompt_ids, max_new_tokens, temperature, top_p, [seed], cancelled, [controls])
        yield from tokens

    def generate_choices(self, prompt_ids, max_new_tokens, temperature, top_p, seeds, cancelled=lambda: False,
                         controls=()):
        """A token iterator per seed (a request's `n` choices): one sequence each, submitted
        together so that they share one prefill and decode in the same steps."""
        stopped, key = self._stopped, object()
        sequences = [Sequence(self._runtime, prompt_ids, max_new_tokens, temperature, top_p, seed,
                              lambda: cancelled() or stopped(), self._interactive, choice_controls,
                              prefill_key=key if len(seeds) > 1 else None, reuse_prefix=self._reuse_prefix)
                     for seed, choice_controls in zip(seeds, controls or [None] * len(seeds))]
        if max_new_tokens <= 0 or self._stopped():
            return [iter(()) for _ in sequences]
        self.sequences.extend(sequences)
        self._scheduler.submit(*sequences)
        return [_Tokens(sequence) for sequence in sequences]


class _Tokens:
    """A submitted sequence's tokens; closing the iterator, started or not, closes the sequence."""

    def __init__(self, sequence):
        self.sequence = sequence

    def __iter__(self):
        return self

    def __next__(self):
        token = self.sequence.next_token()
        if token is None:
            self.close()
            raise StopIteration
        return token

    def close(self):
        self.sequence.close()
