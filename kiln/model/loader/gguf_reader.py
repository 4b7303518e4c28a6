"""The GGUF header reader: gguf's GGUFReader, checked against cut files and quick on long arrays.

- GGUFReader maps every tensor's data while it parses the header, and on a cut file fails with a bare numpy reshape
  error: the extents are checked first, and the first tensor whose data runs past the end is named.
- GGUFReader parses an array one element at a time through the file's memmap (~40 us an element): a tokenizer's
  vocabulary and merges (98,000 strings in SmolLM2's file) took 4.0 s of every start here. A little-endian array of
  strings or numbers is read here with the same parts (a length and a byte view per string, a one-element view per
  number) sliced from a plain array over the same memory: 0.28 s. Other arrays are gguf's own path.
- A process that builds several engines of one file (the debugger's reference and graph engines, a model drafting
  for itself, the bench's modes) parses its header once: `read_header` keeps the last few readers, each while its
  file's size and modification time are unchanged (~0.5 s a start for the default model).
`_build_tensors` and `_get_field_parts` are private hooks of the pinned gguf version (pyproject.toml); tests
compare every field with GGUFReader's.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField

from kiln.errors import ModelLoadError
from kiln.model.loader.base import FileVersion, file_version

READERS_KEPT = 4  # files whose parsed headers a process keeps (each maps its file read-only)
_LITTLE_ENDIAN_FILE = "I"  # GGUFReader.byte_order of a file in this machine's (little-endian) order


def read_header(path: str) -> CheckedReader:
    """The file's reader, shared within the process while the file is unchanged (readers are read-only)."""
    return _reader(os.path.realpath(path), file_version(path))


@functools.lru_cache(maxsize=READERS_KEPT)
def _reader(path: str, version: FileVersion) -> CheckedReader:
    """A parsed header per file version (a file that fails is not kept)."""
    return CheckedReader(path)


class CheckedReader(GGUFReader):
    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        size = len(self.data)
        for f in fields:
            _, name, _, dims, raw_type, offset = f.parts
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block_size
            if end > size:
                tensor = bytes(name).decode("utf-8", errors="replace")
                raise ModelLoadError(
                    self.path, f"truncated: tensor {tensor} ends at byte {end} but the file has {size} bytes"
                )
        super()._build_tensors(start_offs, fields)

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != _LITTLE_ENDIAN_FILE:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if count == 0 or (nptype is None and itype != GGUFValueType.STRING):  # empty, or arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        data = self.data.view(np.ndarray)  # NOTE: slicing a memmap costs ~4 us a slice, a plain array's ~0.3
        parts: list[npt.NDArray[Any]] = [raw_itype, alen]
        types = [GGUFValueType.ARRAY, itype]
        if itype == GGUFValueType.STRING:
            if offs + 8 * count > len(data):
                raise ValueError(f"array of {count} strings at byte {orig_offs} runs past the end of the file")
            raw = memoryview(data)
            for _ in range(count):
                length = int.from_bytes(raw[offs : offs + 8], "little")
                parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + length])
                offs += 8 + length
            if offs > len(data):
                raise ValueError(f"array of {count} strings at byte {orig_offs} runs past the end of the file")
            return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), types
        size = np.dtype(nptype).itemsize * count
        if offs + size > len(data):
            raise ValueError(f"array of {count} {itype.name} at byte {orig_offs} runs past the end of the file")
        values = data[offs : offs + size].view(nptype)
        parts += (values[i : i + 1] for i in range(count))
        return 12 + size, parts, list(range(2, 2 + count)), types
