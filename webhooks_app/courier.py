"""The engine's webhook courier: a companion of the Worker (as the batch runner is) that sends
the outbox's due deliveries and records each answer.

In the engine, not a process of its own: an engine is running wherever batches end, it already
keeps loops beside its requests, and an operator has nothing more to start. Each active engine
runs one; claims (SKIP LOCKED, a fencing token, a claim that lapses after the send timeout) keep
two engines from sending the same attempt, and let another engine send what a dead one claimed.
Sends are asynchronous HTTP on the engine's event loop; the database work runs in its sync thread.
"""

import asyncio
import logging

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from webhooks_app import sending
from webhooks_app.models import Delivery

log = logging.getLogger("millm.webhooks")

CLAIM_BATCH = 8


class WebhookCourier:
    def __init__(self, worker):
        self.worker = worker

    def reconcile(self):
        """Nothing to put right at start-up: a dead engine's claims lapse by themselves."""

    async def run(self):
        async with sending.client() as client:
            while not self.worker.stopping.is_set():
                try:
                    sent = await self.deliver_due(client)
                except Exception:
                    log.exception("webhook deliveries failed; trying again")
                    sent = 0
                if not sent:
                    await self.worker.nap(await sync_to_async(self._pause)())

    async def deliver_due(self, client):
        """Claim up to CLAIM_BATCH due deliveries, send them side by side, record each answer;
        the number claimed."""
        due = await sync_to_async(self._claim)()
        if due and settings.WEBHOOK_TEST_PAUSE_BEFORE_SEND_S:
            await asyncio.sleep(settings.WEBHOOK_TEST_PAUSE_BEFORE_SEND_S)  # tests kill the engine here
        await asyncio.gather(*(self._deliver(client, delivery) for delivery in due))
        return len(due)

    async def _deliver(self, client, delivery):
        endpoint = delivery.endpoint
        attempt = await sending.send(client, endpoint.url, delivery.id, delivery.payload, endpoint.signing_secrets())
        recorded = await sync_to_async(delivery.record)(attempt)
        outcome = f"answered {attempt.status_code}" if attempt.status_code is not None else attempt.error
        log.info("webhook %s (%s) to %s, attempt %d: %s%s", delivery.id, delivery.event_type, endpoint.id,
                 delivery.attempts + 1, outcome, "" if recorded else " (not recorded: another engine took it)")

    def _claim(self):
        close_old_connections()
        return Delivery.objects.claim_due(self.worker.engine_id, CLAIM_BATCH)

    @staticmethod
    def _pause():
        """Until the next delivery is due, at most MILLM_WEBHOOK_POLL_S (a batch that ends in
        another engine writes its deliveries without waking this one)."""
        first = Delivery.objects.next_due_at()
        if first is None:
            return settings.MILLM_WEBHOOK_POLL_S
        return min(settings.MILLM_WEBHOOK_POLL_S, max(0.01, (first - timezone.now()).total_seconds()))
