"""Helpers for tests that drive the model lifecycle: management calls, the resident model."""

import httpx

from tests.e2e.stack import wait_until


def api(stack, method, path, lease=None, **kwargs):
    """A management call, with the lease header when a lease is given."""
    headers = {"X-miLLM-Lease": lease} if lease else {}
    return httpx.request(method, stack.web.url + path, headers=headers, timeout=60, **kwargs)


def resident(stack):
    return httpx.get(stack.web.url + "/api/health/detailed").json()["model_name"]


def wait_resident(stack, model_id):
    wait_until(lambda: resident(stack) == model_id, 60, f"{model_id} did not become resident", stack.engine)
