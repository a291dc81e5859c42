import pytest
from openai import OpenAI

from tests.e2e.stack import Stack

MODEL_ID = "tiny-llama"


@pytest.fixture(scope="session")
def stack(tmp_path_factory, test_model_dir):
    """One engine (the tiny model) and one web process, shared by the end-to-end tests.

    MAX_PENDING_REQUESTS is small so that the queue test can fill it with a few requests.
    """
    with Stack.running(tmp_path_factory.mktemp("e2e"), test_model_dir, MAX_PENDING_REQUESTS=3, BATCH_WAIT_POLL_S=0.2) as stack:
        yield stack


@pytest.fixture
def client(stack):
    return make_client(stack.web.url)


def make_client(url, api_key="unused", strict=True):
    return OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60, _strict_response_validation=strict)
