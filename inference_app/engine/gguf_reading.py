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

The reader itself is gguf's, reading from a plain array over its memory map (`PlainReader`):
gguf slices the `np.memmap` once per value, and a memmap slice costs ten times a plain one
(numpy's `__array_finalize__`); Gemma 3's header (262,144 tokens, scores and types, each value
a slice) took 14-17 s to read, 4.4-6 s this way, with every field and tensor equal.
"""

import contextlib
import functools
import os

import gguf
import numpy as np


class PlainReader(gguf.GGUFReader):
    """gguf's reader with its `_get` slicing a plain ndarray view of the same memory map."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dtype, count = np.dtype(dtype), int(count)
        values = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return values.view(values.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


_GGUFS_OWN_READER = gguf.GGUFReader


def reader(path):
    """The file's reader: inside read_once() the one it shares, else a new PlainReader."""
    if gguf.GGUFReader is _GGUFS_OWN_READER:
        return PlainReader(str(path))
    return gguf.GGUFReader(str(path))


@contextlib.contextmanager
def read_once():
    readers = {}
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = PlainReader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
