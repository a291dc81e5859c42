"""A chunk of single rows gives way to a waiting chat at the next row, not at the chunk's end."""

import asyncio

from batches_app.models import BatchRow
from batches_app.chunks import PendingRow, execute_rows
from inference_app.engine.admission import AdmissionSlot

COMPLETIONS = "/v1/completions"


def scoring_rows(resident, count):
    return [PendingRow.of(COMPLETIONS, BatchRow(
                pk=index + 1, batch_id="batch_test", line=index, custom_id=f"r{index}",
                body={"model": resident.model_id, "prompt": f"Item {index}:", "max_tokens": 1, "logprobs": 2}))
            for index in range(count)]


def test_a_chunk_of_single_rows_ends_at_the_row_where_a_chat_waits(resident):
    rows = scoring_rows(resident, 8)
    asked = []

    def chat_waits_from_the_third_ask():
        asked.append(len(asked))
        return len(asked) >= 3

    whole = execute_rows(resident, COMPLETIONS, rows)
    cut = execute_rows(resident, COMPLETIONS, rows, give_way=chat_waits_from_the_third_ask)
    assert [result.row.line for result in cut] == [0, 1, 2]  # asked before rows 1, 2 and 3: row 3 gave way
    assert len(asked) == 3
    # The rows it ran are the rows the whole chunk ran, answer for answer (ids and times aside).
    def answers(results):
        return [(result.outcome, result.response["choices"], result.response["usage"]) for result in results]

    assert answers(cut) == answers(whole[:3])
    assert all(result.outcome == BatchRow.Outcome.SUCCEEDED for result in whole)


def test_the_first_row_always_runs_and_a_chunk_of_packs_runs_whole(resident):
    rows = scoring_rows(resident, 6)
    assert [result.row.line for result in execute_rows(resident, COMPLETIONS, rows, give_way=lambda: True)] == [0]
    packed = execute_rows(resident, COMPLETIONS, rows, pack=True, give_way=lambda: True)
    assert [result.row.line for result in packed] == list(range(6)) and all(result.packed for result in packed)


def test_the_slot_counts_queued_interactive_requests_for_the_model_thread():
    async def scenario():
        slot = AdmissionSlot(1, 10)
        await slot.acquire(interactive=False)  # a chunk holds the slot
        seen = [slot.interactive_queued]
        chat = asyncio.create_task(slot.acquire(interactive=True))
        batch = asyncio.create_task(slot.acquire(interactive=False))
        gone = asyncio.create_task(slot.acquire(interactive=True))
        await asyncio.sleep(0)
        seen.append(slot.interactive_queued)  # two chats; the waiting chunk does not count
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        seen.append(slot.interactive_queued)  # a chat that gave up no longer counts
        slot.release(False, 0.5)
        await chat
        seen.append(slot.interactive_queued)  # granted: no longer queued
        slot.release(True, 0.1)
        await batch
        seen.append(slot.interactive_queued)
        return seen

    assert asyncio.run(scenario()) == [0, 2, 1, 0, 0]
