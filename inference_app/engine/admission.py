"""The admission slot (SPEC section 8): one queue per engine, interactive before batch.

Interactive requests wait in arrival order and count as pending; when waiting plus holding has
reached MAX_PENDING_REQUESTS the next is refused with queue_full. A batch chunk takes the slot
as a background holder: never pending, never refused, and never granted while an interactive
request waits, so chat always goes first at a chunk boundary. The runner ends a chunk of single
rows at the next row when an interactive request is queued (`interactive_queued`), so that
boundary comes after one row, not a whole chunk.

All methods run on the engine's event loop; none is thread-safe and none needs to be (the model
thread only reads the int `interactive_queued`).
"""

import asyncio
import math
import statistics
import time
from collections import deque
from contextlib import asynccontextmanager

HOLD_SAMPLES = 50
RETRY_AFTER_WITHOUT_ESTIMATE = 5


class QueueFull(Exception):
    def __init__(self, retry_after, pending, limit):
        super().__init__(f"{pending} requests are waiting or running; the limit is {limit}")
        self.retry_after = retry_after
        self.pending = pending
        self.limit = limit


class AdmissionSlot:
    def __init__(self, slots, max_pending):
        self.slots = slots
        self.max_pending = max_pending
        self.holding = 0
        self.interactive_holding = 0
        self._interactive = deque()
        self._background = deque()
        self._hold_seconds = deque(maxlen=HOLD_SAMPLES)
        # Interactive acquirers awaiting the slot, as a plain int so that the model thread may
        # read it (the batch runner ends a chunk of single rows early when it is above 0).
        self.interactive_queued = 0

    @property
    def waiting(self):
        return sum(1 for future in self._interactive if not future.done())

    @property
    def background_waiting(self):
        return sum(1 for future in self._background if not future.done())

    @property
    def pending(self):
        return self.waiting + self.interactive_holding

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
    async def hold(self, interactive=True, limited=True):
        await self.acquire(interactive, limited)
        started = time.monotonic()
        try:
            yield
        finally:
            self.release(interactive, time.monotonic() - started)

    async def acquire(self, interactive=True, limited=True):
        """Wait for the slot; raises QueueFull for an interactive request over the limit.

        limited=False is for the engine's own model swaps: they queue with interactive requests
        but are never refused.
        """
        if interactive and limited and self.pending >= self.max_pending:
            raise QueueFull(self.retry_after(), self.pending, self.max_pending)
        if self.holding < self.slots and not self.waiting and (interactive or not self.background_waiting):
            self._grant(interactive)
            return
        future = asyncio.get_running_loop().create_future()
        queue = self._interactive if interactive else self._background
        queue.append(future)
        self.interactive_queued += interactive
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                # Granted in the same loop turn as the cancel: hand the slot straight on.
                self.release(interactive, None)
            else:
                future.cancel()
            raise
        finally:
            self.interactive_queued -= interactive

    def _grant(self, interactive):
        self.holding += 1
        if interactive:
            self.interactive_holding += 1

    def release(self, interactive, held_seconds):
        self.holding -= 1
        if interactive:
            self.interactive_holding -= 1
        if held_seconds is not None:
            self._hold_seconds.append(held_seconds)
        self._wake()

    def _wake(self):
        while self.holding < self.slots:
            future, interactive = self._next_waiter()
            if future is None:
                return
            self._grant(interactive)
            future.set_result(None)

    def _next_waiter(self):
        for queue, interactive in ((self._interactive, True), (self._background, False)):
            while queue:
                future = queue.popleft()
                if not future.done():
                    return future, interactive
        return None, False
