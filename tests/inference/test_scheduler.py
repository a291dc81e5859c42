"""The step scheduler on the tiny model: many sequences per forward pass, each the same tokens
as alone, each ending on its own."""

import threading
import time

import pytest
import torch

from inference_app.engine.decoding import BatchedDecoder
from inference_app.engine.scheduler import SeatedRuntime, StepScheduler
from millm_lib.errors import ApiError

PROMPTS = [
    "Hello there, how are you",
    "The capital of France is",
    "a",
    "Once upon a time in a land far far away there lived",
    "1 2 3 4",
    "Write a poem about the sea and the sky",
]


@pytest.fixture
def scheduler():
    return StepScheduler(prefill_tokens_per_step=4096)


def alone(resident, prompt, max_tokens, temperature=0.0, top_p=1.0, seed=None):
    return [token.token_id for token in resident.generate(resident.encode(prompt), max_tokens, temperature, top_p, seed)]


def together(resident, scheduler, jobs, start_together=True, controls=None):
    """Each job (prompt, max_tokens, temperature, seed) consumed in a thread of its own, as seated
    requests are; returns each one's token ids and its seated runtime. `controls`: each job's
    sampling controls (tests/inference/test_controls.py)."""
    results = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs)) if start_together else None
    controls = controls or [None] * len(jobs)

    def consume(index, prompt, max_tokens, temperature, seed):
        seated = SeatedRuntime(resident, scheduler, interactive=True)
        if barrier:
            barrier.wait()
        tokens = [token.token_id for token in seated.generate(resident.encode(prompt), max_tokens, temperature, 1.0, seed,
                                                              controls=controls[index])]
        results[index] = (tokens, seated)

    threads = [threading.Thread(target=consume, args=(index, *job)) for index, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_batched_greedy_tokens_equal_one_at_a_time_tokens(resident, scheduler):
    lengths = [12, 20, 7, 16, 20, 3]
    results = together(resident, scheduler, [(prompt, n, 0.0, None) for prompt, n in zip(PROMPTS, lengths)])
    for prompt, n, (tokens, seated) in zip(PROMPTS, lengths, results):
        assert tokens == alone(resident, prompt, n), prompt
    assert scheduler.steps < sum(lengths)  # rows shared their forward passes
    assert any(seated.shared for _, seated in results)
    assert scheduler.live == []


def test_a_seeded_sampled_request_gives_the_same_tokens_alone_and_among_others(resident, scheduler):
    expected = alone(resident, PROMPTS[0], 16, temperature=1.3, seed=1234)
    jobs = [(PROMPTS[0], 16, 1.3, 1234)] + [(prompt, 16, 0.9, 7 + index) for index, prompt in enumerate(PROMPTS[1:])]
    tokens, seated = together(resident, scheduler, jobs)[0]
    assert tokens == expected
    assert seated.shared


def test_closing_one_sequence_ends_it_and_not_the_others(resident, scheduler):
    """A stop sequence (the consumer closes its tokens) frees its row; the others go on."""
    seated_short = SeatedRuntime(resident, scheduler, interactive=True)
    seated_long = SeatedRuntime(resident, scheduler, interactive=True)
    long_tokens = seated_long.generate(resident.encode(PROMPTS[3]), 24, 0.0, 1.0, None)
    first = next(long_tokens)
    short_tokens = seated_short.generate(resident.encode(PROMPTS[1]), 24, 0.0, 1.0, None)
    taken = [next(short_tokens) for _ in range(3)]
    short_tokens.close()  # what a stop sequence does
    assert seated_short.sequences[0].released.is_set()
    rest = list(long_tokens)
    assert [first.token_id] + [token.token_id for token in rest] == alone(resident, PROMPTS[3], 24)
    assert len(taken) == 3 and seated_long.sequences[0].shared


def test_a_cancelled_sequence_leaves_at_the_next_step(resident, scheduler):
    # Cancelled once its second token is made, as the decode thread sees it: a consumer that
    # sets an event after reading a token races the steps that thread runs meanwhile.
    seated = SeatedRuntime(resident, scheduler, interactive=True)
    tokens = seated.generate(resident.encode(PROMPTS[0]), 50, 0.0, 1.0, None,
                             lambda: len(seated.sequences[0].produced) >= 2)
    assert len(list(tokens)) == 2
    assert scheduler.live == []


def test_max_tokens_and_a_lone_sequence_is_serial(resident, scheduler):
    (tokens, seated), = together(resident, scheduler, [(PROMPTS[4], 5, 0.0, None)])
    assert tokens == alone(resident, PROMPTS[4], 5) and len(tokens) <= 5
    assert not seated.shared


def test_rows_that_leave_trim_the_padding_the_others_do_not_need(resident):
    decoder = BatchedDecoder(resident)
    for prompt in (PROMPTS[3], PROMPTS[2]):
        ids = resident.encode(prompt)
        cache, _ = decoder.prefill(ids)
        decoder.admit(cache, len(ids))
    long_width = len(resident.encode(PROMPTS[3]))
    assert decoder.width == long_width
    decoder.drop([0])
    assert decoder.width == len(resident.encode(PROMPTS[2]))
    assert decoder.cache.layers[0].keys.shape[2] == decoder.width


class _OutOfMemoryAtWidth(BatchedDecoder):
    """The device's memory as a GPU's would run out: a step of more than `rows` sequences fails,
    once (a fault injected into the decoder, the model itself untouched)."""

    rows_that_fit = 3
    failures = 0

    def step(self, token_ids):
        if len(token_ids) > self.rows_that_fit and not _OutOfMemoryAtWidth.failures:
            _OutOfMemoryAtWidth.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return super().step(token_ids)


def test_out_of_memory_in_a_step_shrinks_the_batch_and_every_sequence_still_ends_right(resident, scheduler):
    scheduler.decoder_class = _OutOfMemoryAtWidth
    _OutOfMemoryAtWidth.failures = 0
    results = together(resident, scheduler, [(prompt, 16, 0.0, None) for prompt in PROMPTS])
    assert _OutOfMemoryAtWidth.failures == 1
    for prompt, (tokens, _) in zip(PROMPTS, results):
        assert tokens == alone(resident, prompt, 16), prompt
    assert scheduler.chats.capacity is None and scheduler.live == []


def test_a_sequence_whose_sampling_fails_ends_alone(resident, scheduler):
    broken = SeatedRuntime(resident, scheduler, interactive=True)
    healthy = SeatedRuntime(resident, scheduler, interactive=True)
    tokens = healthy.generate(resident.encode(PROMPTS[3]), 20, 0.0, 1.0, None)
    first = next(tokens)
    with pytest.raises(RuntimeError):  # a temperature that makes every probability NaN
        list(broken.generate(resident.encode(PROMPTS[0]), 20, float("nan"), 1.0, 5))
    rest = [token.token_id for token in tokens]
    assert [first.token_id] + rest == alone(resident, PROMPTS[3], 20)


def test_a_seated_request_never_runs_a_whole_model_forward_pass(resident, scheduler):
    seated = SeatedRuntime(resident, scheduler, interactive=True)
    with pytest.raises(AttributeError, match="whole model"):
        seated.last_logits(resident.encode("hi"))
    assert seated.context_length == resident.context_length


@pytest.mark.parametrize("mode", ["pause", "decode"])
def test_batch_rows_pause_while_a_chat_decodes_or_share_its_steps(resident, mode):
    """ENGINE_BATCH_ROWS_BESIDE_CHATS: "pause" runs a chat's steps without the batch rows (which
    resume after it, with the tokens they would have made anyway); "decode" runs them together."""
    scheduler = StepScheduler(4096, batch_rows_beside_chats=mode)
    rows = [SeatedRuntime(resident, scheduler, interactive=False) for _ in range(3)]
    streams = [row.generate(resident.encode(prompt), 300, 0.0, 1.0, None) for row, prompt in zip(rows, PROMPTS[1:4])]
    firsts = [next(stream) for stream in streams]
    chat = SeatedRuntime(resident, scheduler, interactive=True)
    chat_tokens = [token.token_id for token in chat.generate(resident.encode(PROMPTS[0]), 12, 0.0, 1.0, None)]
    rows_live_after_the_chat = len(scheduler.rows.live)
    assert chat_tokens == alone(resident, PROMPTS[0], 12)
    assert chat.shared is (mode == "decode")
    if mode == "pause":
        assert rows_live_after_the_chat == 3  # paused, not finished
    for first, stream, prompt in zip(firsts, streams, PROMPTS[1:4]):
        assert [first.token_id] + [token.token_id for token in stream] == alone(resident, prompt, 300)
    assert all(row.shared for row in rows)


class _ThreadRecording(BatchedDecoder):
    threads = set()

    def prefill(self, prompt_ids):
        _ThreadRecording.threads.add(threading.current_thread())
        return super().prefill(prompt_ids)

    def step(self, token_ids):
        _ThreadRecording.threads.add(threading.current_thread())
        return super().step(token_ids)


def test_every_step_runs_in_the_thread_it_was_given_and_a_drain_ends_when_nothing_decodes(resident):
    """The engine gives the scheduler its model thread: torch's OpenMP workers are one pool."""
    from concurrent.futures import ThreadPoolExecutor

    model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
    the_model_thread = model_thread.submit(threading.current_thread).result()
    scheduler = StepScheduler(prefill_tokens_per_step=4096, thread=model_thread)
    scheduler.decoder_class = _ThreadRecording
    _ThreadRecording.threads = set()
    for round_ in range(2):  # a second burst after the first drain ended starts a new one
        results = together(resident, scheduler, [(prompt, 6, 0.0, None) for prompt in PROMPTS[:3]])
        for prompt, (tokens, _) in zip(PROMPTS, results):
            assert tokens == alone(resident, prompt, 6), prompt
        # The drain has ended (or is ending): the model thread takes other work next.
        assert model_thread.submit(lambda: scheduler._draining).result() is False
    assert _ThreadRecording.threads == {the_model_thread}
    assert scheduler.chats.decoder is None  # an idle scheduler holds no model


def test_a_sequence_submitted_after_the_thread_shut_down_ends_with_a_503(resident):
    from concurrent.futures import ThreadPoolExecutor

    model_thread = ThreadPoolExecutor(1)
    model_thread.shutdown()
    seated = SeatedRuntime(resident, StepScheduler(prefill_tokens_per_step=4096, thread=model_thread), interactive=True)
    with pytest.raises(ApiError) as raised:
        list(seated.generate(resident.encode("Hello"), 4, 0.0, 1.0, None))
    assert raised.value.status == 503


def test_a_drain_cancelled_by_a_stop_before_it_ran_ends_its_waiting_sequences_with_a_503(resident):
    """Seating's shutdown cancels the model thread's queued work: a drain queued behind a job
    (here, one that waits for the stop) never runs, and its sequences must not wait for ever."""
    from concurrent.futures import ThreadPoolExecutor

    model_thread = ThreadPoolExecutor(1)
    busy, stop = threading.Event(), threading.Event()
    model_thread.submit(lambda: (busy.set(), stop.wait(30)))
    busy.wait(30)
    seated = SeatedRuntime(resident, StepScheduler(prefill_tokens_per_step=4096, thread=model_thread), interactive=True)
    outcome = {}

    def consume():
        try:
            list(seated.generate(resident.encode("Hello"), 4, 0.0, 1.0, None))
        except ApiError as error:
            outcome["status"] = error.status

    consumer = threading.Thread(target=consume)
    consumer.start()
    while not seated._scheduler._draining:
        time.sleep(0.01)
    model_thread.shutdown(wait=False, cancel_futures=True)
    stop.set()
    consumer.join(30)
    assert outcome == {"status": 503}
