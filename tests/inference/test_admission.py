"""The admission slot: arrival order, interactive before batch, queue_full, Retry-After."""

import asyncio

import pytest

from inference_app.engine.admission import AdmissionSlot, QueueFull


def run(coroutine):
    return asyncio.run(coroutine)


def test_interactive_requests_go_before_a_waiting_batch_chunk():
    async def scenario():
        slot = AdmissionSlot(1, 10)
        order = []
        await slot.acquire(interactive=True)

        async def take(name, interactive):
            async with slot.hold(interactive):
                order.append(name)

        batch = asyncio.create_task(take("batch", False))
        await asyncio.sleep(0)
        first = asyncio.create_task(take("chat-1", True))
        second = asyncio.create_task(take("chat-2", True))
        await asyncio.sleep(0)
        slot.release(True, 0.1)
        await asyncio.gather(batch, first, second)
        return order

    assert run(scenario()) == ["chat-1", "chat-2", "batch"]


def test_a_batch_chunk_is_never_refused_nor_counted_as_pending():
    async def scenario():
        slot = AdmissionSlot(1, 1)
        await slot.acquire(interactive=False)
        assert slot.pending == 0
        waiter = asyncio.create_task(slot.acquire(interactive=True))
        await asyncio.sleep(0)
        assert slot.pending == 1
        with pytest.raises(QueueFull):
            await slot.acquire(interactive=True)
        slot.release(False, 1.0)
        await waiter
        return slot

    slot = run(scenario())
    assert slot.interactive_holding == 1


def test_queue_full_when_waiting_plus_holding_reaches_the_limit():
    async def scenario():
        slot = AdmissionSlot(1, 2)
        await slot.acquire()
        waiter = asyncio.create_task(slot.acquire())
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as caught:
            await slot.acquire()
        waiter.cancel()
        return caught.value

    full = run(scenario())
    assert (full.pending, full.limit, full.retry_after) == (2, 2, 5)


def test_retry_after_is_the_median_hold_times_the_queue_clamped():
    slot = AdmissionSlot(1, 10)
    for seconds in (1.0, 2.0, 30.0):
        slot._hold_seconds.append(seconds)
    slot.holding, slot._interactive = 1, []
    assert slot.retry_after() == 2
    slot.holding = 100
    assert slot.retry_after() == 60
    slot._hold_seconds.clear()
    slot._hold_seconds.append(0.001)
    slot.holding = 1
    assert slot.retry_after() == 1


def test_a_cancelled_waiter_leaves_the_queue_and_the_slot_moves_on():
    async def scenario():
        slot = AdmissionSlot(1, 10)
        await slot.acquire()
        gone = asyncio.create_task(slot.acquire())
        stays = asyncio.create_task(slot.acquire())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert slot.waiting == 1
        slot.release(True, 0.01)
        await stays
        return slot

    slot = run(scenario())
    assert slot.holding == 1 and slot.waiting == 0


# --- seats (SPEC 8a) ---


def test_generation_sequences_share_seats_and_a_whole_model_request_waits_for_all_of_them():
    async def scenario():
        slot = AdmissionSlot(3, 10)
        for _ in range(3):
            await slot.acquire(shared=True)
        assert slot.shared_holding == 3
        scoring = asyncio.create_task(slot.acquire())  # exclusive: the whole model
        await asyncio.sleep(0)
        slot.release(True, 0.1, shared=True)
        await asyncio.sleep(0)
        assert not scoring.done()  # two sequences still decode
        slot.release(True, 0.1, shared=True)
        slot.release(True, 0.1, shared=True)
        await scoring
        return slot

    slot = run(scenario())
    assert slot.exclusive and slot.holding == 1


def test_batch_rows_never_take_the_last_seat():
    async def scenario():
        slot = AdmissionSlot(4, 10)
        for _ in range(3):
            await slot.acquire(interactive=False, shared=True)
        fourth_row = asyncio.create_task(slot.acquire(interactive=False, shared=True))
        await asyncio.sleep(0)
        assert not fourth_row.done()  # the last seat stays free for a chat
        await slot.acquire(interactive=True, shared=True)  # a chat finds it at once
        fourth_row.cancel()
        return slot

    slot = run(scenario())
    assert slot.background_shared == 3 and slot.shared_holding == 4


def test_a_waiter_that_gives_up_at_the_head_of_the_line_lets_the_others_through():
    async def scenario():
        slot = AdmissionSlot(4, 10)
        await slot.acquire(shared=True)
        embedding = asyncio.create_task(slot.acquire())  # waits for the whole model
        await asyncio.sleep(0)
        chat = asyncio.create_task(slot.acquire(shared=True))  # behind it, in arrival order
        await asyncio.sleep(0)
        assert not chat.done()
        embedding.cancel()
        await asyncio.sleep(0)
        await asyncio.wait_for(chat, 1)  # granted without waiting for a release
        return slot

    slot = run(scenario())
    assert slot.shared_holding == 2


def test_queue_full_counts_the_seats_beside_max_pending():
    async def scenario():
        slot = AdmissionSlot(2, 2)  # two seats, one more may wait: 2 + 2 - 1
        await slot.acquire(shared=True)
        await slot.acquire(shared=True)
        waiter = asyncio.create_task(slot.acquire(shared=True))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as caught:
            await slot.acquire(shared=True)
        waiter.cancel()
        return caught.value

    full = run(scenario())
    assert (full.pending, full.limit, full.max_pending) == (3, 3, 2)
    assert "2 seats" in full.beside_seats


def test_interactive_waits_are_counted_with_their_seconds_and_nothing_else_is():
    """What /metrics' millm_queue_wait_seconds reads: each interactive request granted a seat
    (at once or after waiting) and the seconds it waited; a batch's or a swap's waits are not."""
    async def scenario():
        slot = AdmissionSlot(1, 10)
        await slot.acquire(interactive=True)  # at once: one wait of 0 s
        assert (slot.waits, slot.wait_seconds) == (1, 0.0)
        queued = asyncio.create_task(slot.acquire(interactive=True))
        swap = asyncio.create_task(slot.acquire(interactive=True, limited=False))
        batch = asyncio.create_task(slot.acquire(interactive=False))
        await asyncio.sleep(0.2)
        slot.release(True, 0.2)
        await queued
        slot.release(True, 0.0)
        await swap
        slot.release(True, 0.0)
        await batch
        return slot

    slot = run(scenario())
    assert slot.waits == 2
    assert 0.2 <= slot.wait_seconds < 1.0


def test_a_request_of_n_choices_holds_a_seat_per_choice():
    # issue 29, point 4: each choice is its own sequence and takes a seat; the request counts once.
    async def freed():
        slot = AdmissionSlot(4, 10)
        await slot.acquire(shared=True, choices=3)
        assert (slot.shared_holding, slot.pending) == (3, 1)
        late = asyncio.create_task(slot.acquire(shared=True, choices=2))
        await asyncio.sleep(0)
        assert not late.done() and slot.waiting == 1  # one seat is left: two do not fit
        behind = asyncio.create_task(slot.acquire(shared=True))
        await asyncio.sleep(0)
        assert not behind.done()  # one seat would fit it, but arrival order holds
        slot.release(True, 0.1, shared=True, choices=3)
        await behind
        await late
        assert slot.shared_holding == 3
        slot.release(True, 0.1, shared=True, choices=2)
        slot.release(True, 0.1, shared=True)
        return slot

    assert run(freed()).shared_holding == 0


def test_choices_beyond_the_seats_take_them_all_and_a_batch_row_never_the_last():
    async def scenario():
        slot = AdmissionSlot(3, 10)
        await slot.acquire(shared=True, choices=8)  # n = 8 on 3 seats: all three, never refused
        assert slot.shared_holding == 3
        slot.release(True, 0.1, shared=True, choices=8)
        await slot.acquire(interactive=False, shared=True, choices=8)  # a row: the batch's 2 seats at most
        assert (slot.shared_holding, slot.background_shared) == (2, 2)
        chat = asyncio.create_task(slot.acquire(shared=True))
        await asyncio.sleep(0)
        assert chat.done()  # the last seat stayed free for a chat
        row = asyncio.create_task(slot.acquire(interactive=False, shared=True))
        await asyncio.sleep(0)
        assert not row.done()
        slot.release(False, 0.1, shared=True, choices=8)
        await row
        return slot

    assert run(scenario()).background_shared == 1
