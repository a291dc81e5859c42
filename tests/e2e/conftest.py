import concurrent.futures

import openai
import pytest
from openai import OpenAI

from tests.e2e.stack import Stack

MODEL_ID = "tiny-llama"


@pytest.fixture(scope="session")
def stack(tmp_path_factory, test_model_dir):
    """One engine (the tiny model) and one web process, shared by the end-to-end tests.

    MAX_PENDING_REQUESTS is small so that the queue test can fill it with a few requests.
    ENGINE_MAX_SEQUENCES is 1, the seed's one-at-a-time engine, whose queue these tests count;
    tests/e2e/test_batched_decoding.py runs the step scheduler with seats of its own.
    """
    settings = {"MAX_PENDING_REQUESTS": 3, "BATCH_WAIT_POLL_S": 0.2, "ENGINE_MAX_SEQUENCES": 1}
    with Stack.running(tmp_path_factory.mktemp("e2e"), test_model_dir, **settings) as stack:
        yield stack


@pytest.fixture
def client(stack):
    return make_client(stack.web.url)


def crowd_of_long_chats(client, count, messages):
    """`count` long chats at once: each ("ok", None) or (error code, Retry-After)."""

    def ask(_):
        try:
            client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=700, temperature=0)
            return "ok", None
        except openai.InternalServerError as error:
            return error.code, error.response.headers.get("Retry-After")

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(ask, range(count)))


def make_client(url, api_key="unused", strict=True):
    return OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60, _strict_response_validation=strict)
