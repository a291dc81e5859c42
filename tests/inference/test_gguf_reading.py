"""One reading of a GGUF header per load (inference_app/engine/gguf_reading.py)."""

import gguf
import numpy as np
import pytest

from inference_app.engine import gguf_reading


def tiny_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
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
