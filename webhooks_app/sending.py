"""One signed POST of an event to a receiver, bounded in time and in what is read back.

Signed by the Standard Webhooks scheme (the `standardwebhooks` package): `webhook-id` (the same
on every attempt of a delivery), `webhook-timestamp` (this attempt's time: the SDK's `unwrap`
refuses one older than five minutes), `webhook-signature` (`v1,<base64 HMAC-SHA256>` per secret,
space-separated while a rotated secret overlaps). The OpenAI SDK's `client.webhooks.unwrap`
verifies exactly this.
"""

import asyncio
import email.utils
from dataclasses import dataclass
from datetime import datetime

import httpx
from django.conf import settings
from django.utils import timezone
from standardwebhooks import Webhook

from webhooks_app.models import ANSWER_MAX
from webhooks_app.targets import url_problem

USER_AGENT = "miServer-webhooks/1"


@dataclass(frozen=True, slots=True)
class Attempt:
    at: datetime
    status_code: int | None = None  # None: no answer (network error, timeout, refused URL)
    error: str = ""
    answer: str = ""  # the first ANSWER_MAX bytes of the body, as text
    retry_after: float | None = None
    permanent: bool = False  # a URL the server may not call: no retry helps

    @property
    def delivered(self):
        return self.status_code is not None and 200 <= self.status_code < 300

    @property
    def retryable(self):
        if self.permanent:
            return False
        return self.status_code is None or self.status_code >= 500 or self.status_code in (408, 429)


def signed_headers(message_id, payload, secrets, at):
    signatures = " ".join(Webhook(secret).sign(message_id, at, payload) for secret in secrets)
    return {"webhook-id": message_id, "webhook-timestamp": str(int(at.timestamp())), "webhook-signature": signatures,
            "content-type": "application/json", "user-agent": USER_AGENT}


async def send(client, url, message_id, payload, secrets):
    """POST `payload` to `url`; the Attempt it came to. Never raises for the receiver's sake:
    no answer within MILLM_WEBHOOK_TIMEOUT_S (connection and whole body included), a refused
    connection, a redirect (not followed) or a 10 MB answer are each a bounded attempt."""
    at = timezone.now()
    problem = url_problem(url)
    if problem is not None:
        return Attempt(at, error=problem, permanent=True)
    timeout = settings.MILLM_WEBHOOK_TIMEOUT_S
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, content=payload.encode(), headers=signed_headers(message_id, payload, secrets, at)) as response:
                answer = await _read_at_most(response, ANSWER_MAX)
    except TimeoutError:
        return Attempt(at, error=f"no answer within {timeout:g} s (MILLM_WEBHOOK_TIMEOUT_S)")
    except Exception as error:  # httpx's errors, and anything else a hostile answer may raise: one failed attempt
        return Attempt(at, error=f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
    return Attempt(at, status_code=response.status_code, answer=answer,
                   retry_after=_retry_after(response.headers.get("retry-after"), at))


async def _read_at_most(response, limit):
    kept = bytearray()
    async for chunk in response.aiter_raw():
        kept += chunk[: limit - len(kept)]
        if len(kept) >= limit:
            break  # the rest is never read: leaving the stream closes the connection
    # PostgreSQL text cannot hold NUL, which a binary or compressed (raw) answer may carry.
    return kept.decode("utf-8", errors="replace").replace("\x00", "\ufffd")


def _retry_after(value, at):
    """Seconds from a Retry-After header (seconds, or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # str.isdigit() is true of "²" too, which float() refuses
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, (when - at).total_seconds())


def client():
    """The HTTP client the courier and the test route send with: no redirects followed (a
    receiver must answer itself), no proxy from the environment."""
    return httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=settings.MILLM_WEBHOOK_TIMEOUT_S)
