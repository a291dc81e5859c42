"""The admission slot (SPEC sections 8 and 8a): one queue per engine, interactive before batch.

The slot has `seats` (ENGINE_MAX_SEQUENCES). A *shared* holder is one generation request: it
takes a seat per sequence (`n` choices take `n`, as the policy's `seats_taken` caps them), and
the step scheduler decodes every shared holder's sequences in the same forward passes. An *exclusive* holder (a model swap, a weights edit, a scoring, embedding or
probe request, a serial batch chunk) takes the whole model: it is granted when nothing else holds
a seat, and nothing is granted while it holds.

Interactive requests wait in arrival order and count as pending; when waiting plus holding has
reached MAX_PENDING_REQUESTS + seats - 1 (with one seat: the seed's MAX_PENDING_REQUESTS) the next
is refused with queue_full. A batch takes seats as a background holder: never pending, never
refused, never granted while an interactive request waits, and never holding the last seat: a
background holder is granted only while fewer than `seats - 1` background holders hold one, so
an arriving chat finds a free seat at the next step. The runner ends a chunk of single rows at the
next row when an interactive request is queued (`interactive_queued`), so a chunk boundary comes
after one row, not a whole chunk.

All methods run on the engine's event loop; none is thread-safe and none needs to be (the model
thread only reads the int `interactive_queued`).
"""

import asyncio
import math
import statistics
import time
from collections import deque
from contextlib import asynccontextmanager

from inference_app.engine import policy

HOLD_SAMPLES = 50
RETRY_AFTER_WITHOUT_ESTIMATE = 5


class QueueFull(Exception):
    def __init__(self, retry_after, pending, limit, max_pending=None, seats=1):
        super().__init__(f"{pending} requests are waiting or running; the limit is {limit}")
        self.retry_after = retry_after
        self.pending = pending
        self.limit = limit
        self.max_pending = limit if max_pending is None else max_pending
        # How the limit follows from the seats, for the message (nothing with one seat).
        self.beside_seats = "" if seats == 1 else f" beside {seats} seats (at most {limit} at once)"


class AdmissionSlot:
    def __init__(self, slots, max_pending):
        self.slots = slots
        self.max_pending = max_pending
        self.holding = 0
        self.interactive_holding = 0
        self.exclusive = False
        self.shared_holding = 0
        self.background_shared = 0
        self._interactive = deque()  # (future, seats: 0 for the whole model)
        self._background = deque()
        self._hold_seconds = deque(maxlen=HOLD_SAMPLES)
        # Interactive requests granted a seat, and the seconds they waited for it in all (for
        # /metrics' millm_queue_wait_seconds; a swap's or weights edit's waits are not counted).
        self.waits = 0
        self.wait_seconds = 0.0
        # Interactive acquirers awaiting the slot, as a plain int so that the model thread may
        # read it (the batch runner ends a chunk of single rows early when it is above 0).
        self.interactive_queued = 0

    @property
    def waiting(self):
        return sum(1 for future, _ in self._interactive if not future.done())

    @property
    def background_waiting(self):
        return sum(1 for future, _ in self._background if not future.done())

    @property
    def pending(self):
        return self.waiting + self.interactive_holding

    @property
    def pending_limit(self):
        return policy.pending_limit(self.max_pending, self.slots)

    def retry_after(self):
        """ceil(median hold x (waiting + holding) / slots), clamped to 1..60; 5 without data."""
        if not self._hold_seconds:
            return RETRY_AFTER_WITHOUT_ESTIMATE
        estimate = statistics.median(self._hold_seconds) * (self.waiting + self.holding) / self.slots
        return min(60, max(1, math.ceil(estimate)))

    def estimated_wait_seconds(self):
        if not self._hold_seconds:
            return None
        return round(statistics.median(self._hold_seconds) * (self.waiting + self.holding) / self.slots, 3)

    @asynccontextmanager
    async def hold(self, interactive=True, limited=True, shared=False, choices=1):
        await self.acquire(interactive, limited, shared, choices)
        started = time.monotonic()
        try:
            yield
        finally:
            self.release(interactive, time.monotonic() - started, shared, choices)

    async def acquire(self, interactive=True, limited=True, shared=False, choices=1):
        """Wait for seats (`shared`: one per choice) or the whole model; raises QueueFull for an
        interactive request over the limit (a request counts once, whatever its `choices`).

        limited=False is for the engine's own model swaps and weights edits: they queue with
        interactive requests but are never refused.
        """
        if interactive and limited and self.pending >= self.pending_limit:
            raise QueueFull(self.retry_after(), self.pending, self.pending_limit, self.max_pending, self.slots)
        counted = interactive and limited
        ahead = self.waiting if interactive else self.waiting + self.background_waiting
        seats = policy.seats_taken(choices, self.slots, interactive) if shared else 0
        if not ahead and self._grantable(interactive, seats):
            self._grant(interactive, seats)
            self.waits += counted
            return
        queued_at = time.monotonic()
        future = asyncio.get_running_loop().create_future()
        queue = self._interactive if interactive else self._background
        queue.append((future, seats))
        self.interactive_queued += interactive
        try:
            await future
            if counted:
                self.waits += 1
                self.wait_seconds += time.monotonic() - queued_at
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                # Granted in the same loop turn as the cancel: hand the seats straight on.
                self.release(interactive, None, shared, choices)
            else:
                future.cancel()
                self._wake()  # it may have been the head of the line that held the others back
            raise
        finally:
            self.interactive_queued -= interactive

    def _grantable(self, interactive, seats):
        """`seats` 0: the whole model; else that many seats."""
        if not seats:
            return self.holding == 0
        if self.exclusive or self.shared_holding + seats > self.slots:
            return False
        return interactive or self.background_shared + seats <= policy.batch_seats(self.slots)

    def _grant(self, interactive, seats):
        self.holding += 1
        self.interactive_holding += interactive
        if seats:
            self.shared_holding += seats
            self.background_shared += 0 if interactive else seats
        else:
            self.exclusive = True

    def release(self, interactive, held_seconds, shared=False, choices=1):
        self.holding -= 1
        self.interactive_holding -= interactive
        if shared:
            seats = policy.seats_taken(choices, self.slots, interactive)
            self.shared_holding -= seats
            self.background_shared -= 0 if interactive else seats
        else:
            self.exclusive = False
        if held_seconds is not None:
            self._hold_seconds.append(held_seconds)
        self._wake()

    def _wake(self):
        """Grant waiters in order while the head of the line can be granted: each class in the
        policy's order (interactive ones first), each in arrival order."""
        for interactive in policy.CLASSES_IN_ORDER:
            queue = self._interactive if interactive else self._background
            while queue:
                future, seats = queue[0]
                if future.done():
                    queue.popleft()
                    continue
                if not self._grantable(interactive, seats):
                    return
                queue.popleft()
                self._grant(interactive, seats)
                future.set_result(None)
