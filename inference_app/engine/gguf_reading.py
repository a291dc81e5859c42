"""A GGUF file's header read once per load.

Reading a GGUF header walks every tokenizer string (the default model's 49,152 tokens and its
merges): seconds each time. A first start converts the file through transformers, which reads
it three times (tokenizer, config, weights), and packing reads it once more; transformers also
rebuilds gguf's tensor name map for every module it names. Inside `read_once()` each file is
read once and each name map built once: the default model's first load (conversion, then
load and packing) took 13.7-14.0 s, where it took 27.2-29.0 s (2-core EPYC, 2026-12-04).

transformers takes no reader of ours (`from_pretrained(gguf_file=...)` opens the file itself,
with `from gguf import GGUFReader` at call time), so the block swaps gguf's own two names, and
puts them back after. Loads run one at a time in the engine's model thread; a reader is
read-only (a memory map opened "r"), so sharing it changes nothing that is read.
"""

import contextlib
import functools
import os

import gguf


@contextlib.contextmanager
def read_once():
    readers = {}
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
