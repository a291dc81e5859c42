"""Webhooks in the admin and on /metrics (issue 17, point 4): endpoints without their secret,
deliveries with their status, attempts, last answer and next try, a "retry now" action, and the
deliveries counted by status."""

import re

import pytest
from django.contrib.admin.utils import quote
from django.utils import timezone

from millm_lib import metrics
from webhooks_app.models import Delivery, WebhookEndpoint
from webhooks_app.sending import Attempt

pytestmark = pytest.mark.django_db


def failed_delivery():
    endpoint = WebhookEndpoint.register(name="pipeline", url="http://127.0.0.1:9/down", event_types=["batch.failed"])
    (delivery,) = Delivery.objects.enqueue("batch.failed", {"id": "batch_x"}, timezone.now())
    (claimed,) = Delivery.objects.claim_due("eng_test")
    claimed.record(Attempt(timezone.now(), status_code=404, answer="no such hook"))
    return endpoint, Delivery.objects.get(pk=delivery.pk)


def test_the_admin_shows_a_failed_delivery_and_retries_it_now(admin_client):
    endpoint, delivery = failed_delivery()
    assert delivery.status == "failed"
    listed = admin_client.get("/admin/webhooks_app/delivery/?status__exact=failed").content.decode()
    assert delivery.id in listed and "404" in listed and "batch.failed" in listed
    page = admin_client.get(f"/admin/webhooks_app/delivery/{quote(delivery.id)}/change/").content.decode()
    assert "no such hook" in page and 'name="_save"' not in page  # read, never edited

    done = admin_client.post("/admin/webhooks_app/delivery/", {"action": "retry_now", "_selected_action": [delivery.id]})
    assert done.status_code == 302
    delivery.refresh_from_db()
    assert delivery.status == "pending" and delivery.next_attempt_at <= timezone.now()
    assert delivery.give_up_at >= delivery.next_attempt_at  # at least one more attempt


def test_the_admin_lists_endpoints_with_a_hint_never_the_secret_and_has_no_add(admin_client):
    endpoint, _ = failed_delivery()
    listed = admin_client.get("/admin/webhooks_app/webhookendpoint/").content.decode()
    assert endpoint.secret_hint in listed and endpoint.secret not in listed
    page = admin_client.get(f"/admin/webhooks_app/webhookendpoint/{quote(endpoint.id)}/change/").content.decode()
    assert endpoint.secret not in page
    assert admin_client.get("/admin/webhooks_app/webhookendpoint/add/").status_code == 403
    assert admin_client.get("/admin/webhooks_app/delivery/add/").status_code == 403


def test_metrics_count_deliveries_and_attempts_by_status():
    def samples(name):
        text = metrics.render().decode()
        return {labels: float(value) for labels, value in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M)}

    before = samples("millm_webhook_deliveries")
    assert set(before) == {'status="pending"', 'status="succeeded"', 'status="failed"'}
    failed_delivery()
    after = samples("millm_webhook_deliveries")
    assert after['status="failed"'] == before['status="failed"'] + 1
    assert samples("millm_webhook_attempts")['status="failed"'] >= 1
