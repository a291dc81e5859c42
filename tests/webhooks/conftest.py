import pytest

from tests.webhooks.receiver import Receiver


@pytest.fixture
def receiver():
    with Receiver() as running:
        yield running
