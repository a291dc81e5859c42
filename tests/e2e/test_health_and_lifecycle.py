"""Health, metrics, and requests whose caller left or whose timeout passed."""

import threading
import time

import httpx
import pytest

from tests.e2e.conftest import MODEL_ID
from tests.e2e.stack import wait_until

LONG = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 700, "temperature": 0}


def unrun(stack):
    return stack.sql("SELECT count(*) FROM batches_app_batchrow r JOIN batches_app_batch b ON b.id = r.batch_id "
                     "WHERE r.outcome = 'pending' AND b.status IN ('validating', 'in_progress') AND b.end_status IS NULL")[0][0]


def test_health_is_bare_and_detailed_reports_engines_and_queue(stack):
    assert httpx.get(stack.web.url + "/api/health").json()["status"] == "ok"
    detailed = httpx.get(stack.web.url + "/api/health/detailed").json()
    assert detailed["model_loaded"] is True and detailed["model_name"] == MODEL_ID
    assert isinstance(detailed["timestamp"], int)
    engine = next(e for e in detailed["engines"] if e["model"] == MODEL_ID and e["role"] == "active")
    assert engine["alive"] is True and isinstance(engine["last_heartbeat"], int)
    inference = detailed["inference"]
    unrun_before = unrun(stack)
    backlog = httpx.get(stack.web.url + "/api/health/detailed").json()["inference"]["batch_backlog_rows"]
    assert inference["backend"] == "serial"
    assert inference["queue_max_pending"] == 3  # this stack's MAX_PENDING_REQUESTS
    # Counted from the database: the valid rows not yet run of the active batches (the shared
    # stack may still run an earlier module's), read between two counts of its own.
    assert unrun(stack) <= backlog <= unrun_before
    assert {"queue_pending", "queue_max_concurrent", "in_flight", "queue_waiting", "estimated_wait_seconds"} <= set(inference)


def test_metrics_are_prometheus_text_with_requests_and_engines(stack, client):
    client.models.list()
    response = httpx.get(stack.web.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    assert 'millm_http_requests_total{method="GET",route="v1/models",status="200"}' in response.text
    assert f'millm_engine_alive{{engine="{stack.engine_id()}",model="{MODEL_ID}"}} 1.0' in response.text
    assert 'millm_batches{status="in_progress"}' in response.text  # batch states and rows, from the database
    for series in ("millm_batch_rows", "millm_batch_tokens", "millm_batch_rows_per_second", "millm_batch_backlog_rows"):
        assert f"# TYPE {series} gauge" in response.text


def test_a_request_whose_caller_left_is_dropped_before_it_runs(stack):
    # Two long generations ahead of it (MAX_PENDING_REQUESTS is 3), so it surely still waits
    # when its caller gives up, however fast the machine is.
    holders = [threading.Thread(target=lambda: httpx.post(stack.web.url + "/v1/chat/completions", json=LONG, timeout=60))
               for _ in range(2)]
    for holder in holders:
        holder.start()
    time.sleep(0.3)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.web.url + "/v1/chat/completions", json={**LONG, "max_tokens": 3}, timeout=0.5)
    for holder in holders:
        holder.join()
    wait_until(lambda: "its caller left" in stack.engine.log(), 10, "the engine did not drop the abandoned request")


def test_a_request_past_its_timeout_is_504_and_dropped(stack):
    web = stack.start_web(MILLM_REQUEST_TIMEOUT_S=0.5)
    holders = [threading.Thread(target=lambda: httpx.post(stack.web.url + "/v1/chat/completions", json=LONG, timeout=60))
               for _ in range(2)]  # ahead of it, longer than its timeout however fast the machine is
    for holder in holders:
        holder.start()
    time.sleep(0.3)
    response = httpx.post(web.url + "/v1/chat/completions", json={**LONG, "max_tokens": 3}, timeout=30)
    for holder in holders:
        holder.join()
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "request_timeout"
    assert "MILLM_REQUEST_TIMEOUT_S" in response.json()["error"]["message"]
    web.stop()
