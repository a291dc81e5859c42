"""Engines come and go: 503 without one, standbys, the queue limit, bearer keys."""

import signal
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import MODEL_ID, crowd_of_long_chats, make_client
from tests.e2e.stack import Stack, wait_until

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture
def isolated(tmp_path, test_model_dir):
    """A stack of its own: stopping its only engine leaves no engine that could auto-load."""
    with Stack.running(tmp_path, test_model_dir) as stack:
        yield stack


def test_without_a_live_engine_requests_are_503_engine_unavailable(isolated):
    client = make_client(isolated.web.url)
    assert client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=2).choices

    # A clean stop removes the engine at once.
    assert isolated.engine.stop() == 0
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=2)
    assert caught.value.status_code == 503
    assert caught.value.code == "engine_unavailable"
    assert "runbatchworker" in caught.value.message
    assert int(caught.value.response.headers["Retry-After"]) >= 1


def test_a_killed_engine_is_503_once_its_heartbeat_is_stale(isolated):
    client = make_client(isolated.web.url)
    isolated.engine.popen.send_signal(signal.SIGKILL)
    isolated.engine.popen.wait()
    stale_s = float(isolated.env["ENGINE_STALE_S"])

    def refused():
        """One request, answered 503 engine_unavailable (nothing else, and no retry): its seconds."""
        sent = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=2)
        assert caught.value.status_code == 503 and caught.value.code == "engine_unavailable"
        return time.monotonic() - sent

    # Sent while the dead engine's heartbeat still looks fresh: forwarded to it, and refused once
    # web sees the heartbeat stale (it checks every ENGINE_STALE_S), not after the 60 s timeout.
    assert refused() <= 2 * stale_s + 3
    # Sent once it is stale: refused at once, without forwarding.
    time.sleep(stale_s)
    assert refused() < stale_s


def test_a_second_engine_for_the_same_model_waits_as_a_standby(stack, client):
    standby = stack.start_engine()

    def standby_registered():
        return any(e["role"] == "standby" and e["alive"] for e in stack.engines(stack.web))

    wait_until(standby_registered, 60, "the second engine did not register as a standby", standby)
    active = [e for e in stack.engines(stack.web) if e["role"] == "active" and e["model"] == MODEL_ID]
    assert len(active) == 1
    assert client.chat.completions.create(model=MODEL_ID, messages=MESSAGES, max_tokens=2).choices
    assert "standby" in standby.log()
    assert standby.stop() == 0


def test_queue_full_once_waiting_plus_holding_reaches_the_limit(stack):
    # MAX_PENDING_REQUESTS is 3 here: one holds the slot, two wait, the rest are refused.
    outcomes = crowd_of_long_chats(make_client(stack.web.url), 8, MESSAGES)
    refused = [retry for code, retry in outcomes if code == "queue_full"]
    served = [code for code, _ in outcomes if code == "ok"]
    assert len(served) >= 3, outcomes
    assert refused, outcomes
    assert len(served) + len(refused) == 8, outcomes
    assert all(retry is not None and 1 <= int(retry) <= 60 for retry in refused)


def test_with_keys_set_every_route_but_health_needs_a_bearer_key(stack):
    web = stack.start_web(MILLM_API_KEYS="key-one,key-two")
    assert httpx.get(web.url + "/api/health").status_code == 200
    assert httpx.get(web.url + "/api/health/detailed").status_code == 200

    with pytest.raises(openai.AuthenticationError) as caught:
        make_client(web.url, api_key="wrong").models.list()
    assert caught.value.code == "invalid_api_key"
    assert caught.value.response.headers["x-should-retry"] == "false"
    no_key = httpx.post(web.url + "/v1/chat/completions", json={"model": MODEL_ID, "messages": MESSAGES})
    assert no_key.status_code == 401
    assert no_key.json()["error"]["type"] == "authentication_error"
    assert httpx.get(web.url + "/metrics").status_code == 401

    answer = make_client(web.url, api_key="key-two").chat.completions.create(
        model=MODEL_ID, messages=MESSAGES, max_tokens=2
    )
    assert answer.choices
    web.stop()
