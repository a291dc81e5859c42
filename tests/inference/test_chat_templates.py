"""Where a model's chat template comes from (issue 44): the setting (a well-known name or a
Jinja file) over the model's own (a GGUF's metadata, a folder's files); none is a 400 naming
MILLM_CHAT_TEMPLATE, and the template's turn-end token stops generation."""

import json

import pytest
from django.core.exceptions import ImproperlyConfigured
from transformers import AutoTokenizer

from inference_app import chat_templates
from inference_app.catalogue import default_model_path, model_source
from inference_app.engine.loader import load_model
from inference_app.engine.runtime import ResidentModel
from inference_app.models import ModelEntry
from inference_app.schemas import ChatMessage
from millm_lib.errors import ApiError

QUESTION = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi?")]


@pytest.fixture(scope="module")
def untemplated(second_gguf):
    """The second real model, whose file names no chat template, as the engine loads it."""
    return ResidentModel(load_model(model_source(str(second_gguf))))


def test_a_ggufs_own_template_comes_from_its_metadata():
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    template = chat_templates.resolve(tokenizer, None)
    assert template.present and template.origin == "the model's own" and "<|im_start|>" in template.text


def test_a_folders_own_template_comes_from_its_files(resident):
    assert resident.chat_template.origin == "the model's own"
    assert resident.render_chat(QUESTION).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_the_setting_names_a_well_known_template_or_a_jinja_file_over_the_models_own(resident, tmp_path):
    tokenizer = resident.tokenizer
    named = chat_templates.resolve(tokenizer, "gemma")
    assert named.text == (chat_templates.FOLDER / "gemma.jinja").read_text() and "well-known" in named.origin
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    from_file = chat_templates.resolve(tokenizer, str(path))
    assert from_file.text == path.read_text() and "a Jinja file" in from_file.origin
    with pytest.raises(ImproperlyConfigured, match="MILLM_CHAT_TEMPLATE must name a well-known chat template"):
        chat_templates.resolve(tokenizer, "no-such-template")


def test_a_model_with_no_template_refuses_chat_naming_the_setting_and_still_completes(untemplated):
    assert not untemplated.chat_template.present
    with pytest.raises(ApiError) as refused:
        untemplated.render_chat(QUESTION)
    assert refused.value.status == 400 and refused.value.code == "chat_template_missing"
    assert "MILLM_CHAT_TEMPLATE" in str(refused.value)
    produced = list(untemplated.generate(untemplated.encode("The capital of France is"), 3, 0.0, 1.0, None))
    assert len(produced) >= 1


def test_with_the_setting_it_renders_that_template_with_one_bos_and_stops_at_its_turn_end(second_gguf):
    gemma = ResidentModel(load_model(model_source(str(second_gguf), chat_template="gemma")))
    prompt = gemma.render_chat(QUESTION)
    assert prompt == "<bos><start_of_turn>user\nBe brief.\n\nHi?<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma.encode(prompt)
    assert ids[0] == gemma.tokenizer.bos_token_id and ids[1] != gemma.tokenizer.bos_token_id  # one BOS, not two
    assert gemma.tokenizer.convert_tokens_to_ids("<end_of_turn>") in gemma.eos_ids


@pytest.mark.django_db
def test_a_registration_names_its_template_and_an_unknown_one_is_refused(client, second_gguf):
    def register(**fields):
        return client.post("/api/models", json.dumps({"source": str(second_gguf), **fields}),
                           content_type="application/json")

    refused = register(id="gemma-unknown", chat_template="no-such-template")
    assert refused.status_code == 400
    assert refused.json()["error"]["details"]["field"] == "chat_template" and "no-such-template" in refused.json()["error"]["message"]
    assert not ModelEntry.objects.filter(pk="gemma-unknown").exists()
    created = register(id="gemma-chat", chat_template="gemma")
    assert created.status_code == 201 and created.json()["data"]["chat_template"] == "gemma"
    assert ModelEntry.objects.get(pk="gemma-chat").chat_template == "gemma"
