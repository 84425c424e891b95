"""A lean GGUF reader: the metadata and the tensors' places in a memory mapping of the file.

gguf-py's GGUFReader builds a numpy view for every string of every array, which takes 7-8 s for a
49k-token vocabulary on our CPUs and would be most of a load (llama.cpp reads the same header in
milliseconds). Here arrays of strings are skipped, keeping only their length (the tokenizer reads its
own vocabulary, once: `gguf_file.convert_tokenizer`), and numbers are read in bulk. The format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types: id -> (struct format, numpy dtype); 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass
class StringArray:
    """An array of strings whose contents were skipped."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the row length first (as gguf-py's ReaderTensor.shape)
    data: np.ndarray  # the raw bytes, uint8 [rows, bytes per row] ([bytes] for a vector), read-only, mapped
    offset: int  # where those bytes begin in the file


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.mapping = np.memmap(path, dtype=np.uint8, mode="r")
        self.position = 0
        if self._bytes(4) != MAGIC:
            raise ValueError("no GGUF magic at the start of the file")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not one this reader knows (2, 3)")
        tensor_count, field_count = self._scalar("<Q"), self._scalar("<Q")
        self.fields = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self.position // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _bytes(self, n: int) -> bytes:
        if self.position + n > len(self.mapping):
            raise ValueError("the file ends inside its header (truncated?)")
        out = self.mapping[self.position:self.position + n].tobytes()
        self.position += n
        return out

    def _scalar(self, fmt: str):
        return struct.unpack(fmt, self._bytes(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._bytes(self._scalar("<Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item == STRING:
            view, unpack = memoryview(self.mapping), struct.Struct("<Q").unpack_from
            try:
                for _ in range(count):  # skipped: only their lengths are read
                    self.position += 8 + unpack(view, self.position)[0]
            except struct.error:
                raise ValueError("the file ends inside its header (truncated?)") from None
            if self.position > len(self.mapping):
                raise ValueError("the file ends inside its header (truncated?)")
            return StringArray(count)
        if item not in _SCALARS:
            raise ValueError(f"unsupported GGUF array item type {item}")
        dtype = np.dtype(_SCALARS[item])
        return np.frombuffer(self._bytes(count * dtype.itemsize), dtype=dtype).tolist()

    def _tensor_info(self):
        name = self._string()
        dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
        kind, offset = self._scalar("<I"), self._scalar("<Q")
        try:
            tensor_type = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"tensor {name} has an unknown GGML type {kind}") from None
        return name, tensor_type, tuple(dims), offset

    def _tensor(self, start: int, name: str, tensor_type, dims: tuple[int, ...], offset: int) -> Tensor:
        block, type_bytes = GGML_QUANT_SIZES[tensor_type]
        if dims[0] % block:
            raise ValueError(f"tensor {name}: rows of {dims[0]} values are not whole {tensor_type.name} blocks")
        row_bytes = dims[0] // block * type_bytes
        rows = int(np.prod(dims[1:], dtype=np.int64))
        begin = start + offset
        if begin + rows * row_bytes > len(self.mapping):
            raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
        data = self.mapping[begin:begin + rows * row_bytes]
        return Tensor(name, tensor_type, dims, data.reshape(rows, row_bytes) if len(dims) > 1 else data, begin)

    def release(self, tensor: Tensor) -> None:
        """Drop the pages of a tensor that has been read from this process's memory (they stay in the
        page cache): a file read tensor by tensor then holds one tensor's pages at a time, not the
        whole file's."""
        start = -(-tensor.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (tensor.offset + tensor.data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
