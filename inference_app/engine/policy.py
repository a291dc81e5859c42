"""The scheduling policy (SPEC 8, 8a and 10c): every decision about whose work runs when, each a
named function with no state of its own. The admission slot, the step scheduler, the batch runner
and the gateway ask it; they keep only the mechanism (queues, locks, forward passes, claims).

- who goes first: `place_in_line` (an interactive request before every batch row, behind earlier
  interactive ones) and `CLASSES_IN_ORDER` (the admission slot grants in that order);
- how many requests may wait: `pending_limit`; how many seats a batch may take: `batch_seats`;
- the lane mode: `lane_mode`;
- the prefill budget per step: `joins_this_step`; whether joiners share one prefill:
  `prefills_together`, `fits_together`;
- when a background holder gives way: `gives_way`;
- which batch an engine takes next: `NEXT_BATCH_ORDER` and `claimable_beside`;
- which replica a request goes to: `least_busy`.
"""

import random

from django.db.models import Q

# The admission slot's classes of work in the order it grants them: interactive, then background.
CLASSES_IN_ORDER = (True, False)


def place_in_line(waiting_interactive, waiting, interactive):
    """Where a new waiter stands among `waiting` of which `waiting_interactive` are interactive
    (they stand first): an interactive one behind the earlier interactive ones, ahead of every
    batch row; a batch row at the end."""
    return waiting_interactive if interactive else waiting


def pending_limit(max_pending, seats):
    """How many requests may wait or run at once before the next is refused (429): the seed's
    MAX_PENDING_REQUESTS with one seat, and one more for each further seat."""
    return max_pending + seats - 1


def batch_seats(seats):
    """The seats background work (batch rows) may hold at once: all but one, so a chat always
    finds a seat; one when there is only one."""
    return max(1, seats - 1)


def seats_taken(choices, seats, interactive):
    """The seats a generation request of `choices` sequences (`n`) holds: one per choice, at
    most every seat (a chat) or every seat a batch may take (a row), so that it can be granted."""
    return max(1, min(choices, seats if interactive else batch_seats(seats)))


def lane_mode(setting, device_type):
    """ENGINE_BATCH_ROWS_BESIDE_CHATS: "decode" (batch rows share the chats' forward passes) or
    "pause" (they wait while a chat decodes). `auto`: pause on a CPU, where a wider step costs
    several narrow ones, and decode on a GPU, where it costs little more."""
    if setting == "auto":
        return "decode" if device_type == "cuda" else "pause"
    return setting


def joins_this_step(joined, prompt_tokens, budget_left, room):
    """Whether the next waiting sequence (`prompt_tokens` long) joins at this step boundary, after
    `joined` others did: while the lane has room, and within the prefill budget, except that the
    first always joins (a prompt longer than the budget would otherwise never start)."""
    if joined >= room:
        return False
    return not joined or prompt_tokens <= budget_left


def prefills_together(setting, dtype_name):
    """ENGINE_PREFILL_TOGETHER: whether prompts that join at one step boundary share one padded
    forward pass ("on") or each runs its own ("off", a lone request's exact pass). `auto`: together
    except in float32 (`dtype_name`, the runtime's), the dtype whose promise is that a batched row
    gives the tokens of the row run alone (a wider matmul accumulates in another order). By name:
    web processes import this module and never torch."""
    if setting == "auto":
        return dtype_name != "float32"
    return setting == "on"


def fits_together(rows, longest, budget):
    """Whether `rows` prompts left-padded to `longest` tokens share one prefill: the padded pass
    stays within the prefill budget of a step (padding is computed like any token)."""
    return rows * longest <= budget


def gives_way(interactive_waiting):
    """Whether background work holding the whole model (a serial batch chunk) stops at its next
    row: an interactive request is waiting for the model."""
    return interactive_waiting > 0


# Which batch an engine claims next, as an ordering of Batch rows annotated with `runs_rows` (0:
# an end to carry out, 1: rows to run): ends first (they are quick), then the oldest, then by id.
NEXT_BATCH_ORDER = ("runs_rows", "created_at", "id")


def claimable_beside(led_elsewhere_created_at):
    """The batches (a filter on the same annotation) a replica may claim while another replica
    leads a batch created at `led_elsewhere_created_at` (None: none does): any end, and rows only
    of an older batch; else it helps the led one (every replica works on the oldest batch first,
    and one live lease per model means a newer batch would wait for it anyway)."""
    if led_elsewhere_created_at is None:
        return Q()
    return Q(runs_rows=0) | Q(created_at__lt=led_elsewhere_created_at)


def least_busy(engines, in_flight):
    """Of a model's replicas, the one with the least work: its queue and the requests it runs (its
    heartbeat's figures) plus `in_flight[engine id]` (this web process's requests to it, always
    fresh); ties at random."""
    def work(engine):
        return engine.queue_waiting + engine.in_flight + in_flight[engine.pk], random.random()

    return min(engines, key=work)
