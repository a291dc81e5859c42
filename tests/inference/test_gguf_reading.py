"""One reading of a GGUF header per load (inference_app/engine/gguf_reading.py)."""

import gguf
import numpy as np
import pytest

from inference_app.engine import gguf_reading


def tiny_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_token_list(["<s>", "a", "b", "ab", "\u00e9t\u00e9"])
    writer.add_token_scores([0.0, -1.0, -2.0, -1.5, -3.25])
    writer.add_token_types([3, 1, 1, 1, 1])
    writer.add_chat_template("{{ messages }}")
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_inside_read_once_a_file_is_read_once_and_gguf_is_itself_again_after_even_on_error(tmp_path):
    path = tiny_gguf(tmp_path / "tiny.gguf")
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError), gguf_reading.read_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first  # the same file, by another spelling: no second reading
        assert [tensor.name for tensor in first.tensors] == ["token_embd.weight"]
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("a load that fails")
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(str(path)) is not first


def test_the_plain_reader_reads_every_field_and_tensor_as_gguf_does_from_plain_arrays(tmp_path):
    path = tiny_gguf(tmp_path / "tiny.gguf")
    theirs, ours = gguf.GGUFReader(str(path)), gguf_reading.PlainReader(str(path))
    assert list(ours.fields) == list(theirs.fields) and len(theirs.fields["tokenizer.ggml.tokens"].data) == 5
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert [(part.dtype, part.shape) for part in mine.parts] == [(part.dtype, part.shape) for part in field.parts]
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts)), name
        assert mine.contents() == field.contents(), name
        assert not any(isinstance(part, np.memmap) for part in mine.parts)  # what makes it fast
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.data.dtype) == (tensor.name, tensor.tensor_type, tensor.data.dtype)
        assert np.array_equal(mine.data, tensor.data)
    assert isinstance(gguf_reading.reader(path), gguf_reading.PlainReader)  # outside read_once too
    with gguf_reading.read_once():
        assert isinstance(gguf.GGUFReader(str(path)), gguf_reading.PlainReader)
        assert gguf_reading.reader(path) is gguf.GGUFReader(path)
