"""Who runs the model, and where: the one interface that interactive serving and the batch
runner share.

- `exclusive(...)`: the whole model (a scoring, embedding or probe request, a serial batch chunk,
  a generation request when seats are 1): the admission slot's exclusive hold, the function in
  the model thread.
- `seated(...)`: one seat (a generation request or a `batched_decoding` batch row): a shared hold,
  the function in a service thread of its own with a `SeatedRuntime`, whose sequences the step
  scheduler decodes together, in the model thread too: every forward pass runs in that one thread.

Both check, once the hold is granted, that the model they were asked for is resident with clean
weights (a swap or an edit may have taken the slot first) and answer `NOT_RUN` otherwise. The
hold lasts until the thread is done, even if the awaiting task is cancelled meanwhile: a seat or
the model is never handed on while its forward pass runs.
"""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings

from inference_app.engine import policy
from inference_app.engine.admission import AdmissionSlot
from inference_app.engine.scheduler import SeatedRuntime, StepScheduler

NOT_RUN = object()


class Seating:
    def __init__(self, residency):
        """`residency`: an object with `runtime` and `weights_torn` (the engine's resident model)."""
        self.residency = residency
        self.seats = settings.ENGINE_MAX_SEQUENCES
        self.slot = AdmissionSlot(self.seats, settings.MAX_PENDING_REQUESTS)
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.service_threads = ThreadPoolExecutor(self.seats, thread_name_prefix="service")
        # Every forward pass in one thread, the scheduler's steps too (scheduler.py says why).
        self.scheduler = StepScheduler(settings.ENGINE_PREFILL_TOKENS_PER_STEP, settings.ENGINE_BATCH_ROWS_BESIDE_CHATS,
                                       thread=self.model_thread, prefill_together=settings.ENGINE_PREFILL_TOGETHER)

    @property
    def batched(self):
        """Whether generation shares forward passes at all (ENGINE_MAX_SEQUENCES > 1)."""
        return self.seats > 1

    def give_way(self):
        """Asked by a serial chunk's model thread before each row: a chat is waiting."""
        return policy.gives_way(self.slot.interactive_queued)

    async def exclusive(self, model_id, function, *args, interactive=False):
        """`function(runtime, *args)` in the model thread, holding the whole model."""
        return await self.run(model_id, function, *args, interactive=interactive)

    async def seated(self, model_id, function, *args, interactive=False, choices=1, reuse_prefix=False):
        """`function(seated runtime, *args)` in a service thread, holding a seat per choice."""
        return await self.run(model_id, function, *args, interactive=interactive, shared=True, choices=choices,
                              reuse_prefix=reuse_prefix)

    async def run(self, model_id, function, *args, interactive=False, shared=False, cancelled=None, deadline=None,
                  on_start=None, choices=1, reuse_prefix=False):
        """`function(runtime, *args)` holding the whole model (in the model thread) or, `shared`,
        a seat per choice (`choices`: the request's `n`; in a service thread, the runtime a
        SeatedRuntime that stops once `cancelled` is set). An interactive hold counts against the pending limit (QueueFull). `deadline` (a
        time.time()): TimeoutError if the hold is not granted by then. `on_start()` is called
        once the function is about to run. NOT_RUN (the hold given back at once) when the model is
        not resident with clean weights by the time the hold is granted. `reuse_prefix`: a seated
        runtime's prefills may begin from a cached prefix (prefix_cache.py)."""
        cancelled = cancelled or threading.Event()
        async with asyncio.timeout(None if deadline is None else deadline - time.time()):
            await self.slot.acquire(interactive, interactive, shared, choices)
        started = time.monotonic()
        ran = False
        try:
            runtime = self._runnable(model_id)
            if runtime is None:
                return NOT_RUN
            if shared:
                runtime = SeatedRuntime(runtime, self.scheduler, interactive, cancelled.is_set, reuse_prefix)
            if on_start is not None:
                on_start()
            ran = True
            return await self.in_thread(shared, function, runtime, *args, on_cancel=cancelled.set)
        finally:
            self.slot.release(interactive, time.monotonic() - started if ran else None, shared, choices)

    def _runnable(self, model_id):
        runtime = self.residency.runtime
        if runtime is None or runtime.model_id != model_id or self.residency.weights_torn:
            return None
        return runtime

    async def in_thread(self, shared, function, *args, on_cancel=None):
        """`function(*args)` in a service thread (`shared`) or the model thread, awaited; a
        cancel of the awaiting task calls `on_cancel()` and waits for the thread to finish
        before it propagates."""
        executor = self.service_threads if shared else self.model_thread
        work = asyncio.get_running_loop().run_in_executor(executor, function, *args)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel()
            while not work.done():  # a second cancel (a shutdown) must not hand the seat on early
                try:
                    await asyncio.wait({work})
                except asyncio.CancelledError:
                    continue
            raise

    def shutdown(self):
        self.model_thread.shutdown(wait=False, cancel_futures=True)
        self.service_threads.shutdown(wait=False, cancel_futures=True)
