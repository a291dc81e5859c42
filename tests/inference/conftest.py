"""Fixtures shared by the inference tests."""

import pytest

from inference_app.catalogue import model_source


@pytest.fixture
def default_source(settings):
    """The packaged default GGUF, as a server with no MILLM_MODEL loads it."""
    settings.MILLM_MODEL = None
    settings.MILLM_MODEL_ID = None
    return model_source()
