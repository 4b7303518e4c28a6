"""kiln's GGUF header reader (kiln.model.loader.gguf_reader) reads every field as gguf's GGUFReader does, once a
process while the file is unchanged."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from kiln.errors import ModelLoadError
from kiln.model.build import load_tokenizer
from kiln.model.loader import default_model_path, open_checkpoint
from kiln.model.loader.gguf_loader import GGUFCheckpoint
from kiln.model.loader.gguf_reader import CheckedReader
from tests.engine.tiny_models import write_gguf_file


def assert_same_fields(path: str) -> None:
    ours, theirs = CheckedReader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), key
        assert len(mine.parts) == len(field.parts), key
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), key
        assert mine.contents() == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]


def test_the_default_models_fields_read_as_gguf_reads_them():
    assert_same_fields(default_model_path())


def test_every_kind_of_array_reads_as_gguf_reads_it(tmp_path: Path):
    path = tmp_path / "arrays.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["a", "", "näive ☃", "x" * 300])
    w.add_array("t.one_string", ["only"])
    w.add_array("t.empty", [])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.scalar_string", "s")
    w.add_uint32("t.scalar", 7)
    w.add_tensor("w", np.arange(8, dtype=np.float32))
    write_gguf_file(w)
    assert_same_fields(str(path))
    fields = CheckedReader(str(path)).fields
    assert fields["t.strings"].contents() == ["a", "", "näive ☃", "x" * 300]
    assert fields["t.ints"].types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
    assert fields["t.nested"].types[:2] == [GGUFValueType.ARRAY, GGUFValueType.ARRAY]  # gguf's own path


def test_a_file_cut_inside_an_array_is_an_error_naming_it(tmp_path: Path):
    path = tmp_path / "cut.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("t.strings", [f"token{i}" for i in range(1000)])
    write_gguf_file(w)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf.*not a readable GGUF file"):
        GGUFCheckpoint(str(path))


def test_a_process_parses_a_files_header_once_until_the_file_changes(tmp_path: Path):
    """Engines of one file in one process share its parsed header and its tokenizer; a rewritten file is read anew."""
    path = tmp_path / "model.gguf"

    def write(value: int) -> None:
        w = GGUFWriter(str(path), "llama")
        w.add_uint32("t.value", value)
        w.add_array("t.strings", [f"token{i}" for i in range(value)])
        w.add_tensor("w", np.arange(8, dtype=np.float32))
        write_gguf_file(w)

    write(3)
    first = GGUFCheckpoint(str(path))
    assert GGUFCheckpoint(str(path)).reader is first.reader
    assert first.field("t.value") == 3
    write(5)  # another size and modification time
    again = GGUFCheckpoint(str(path))
    assert again.reader is not first.reader and again.field("t.value") == 5
    assert again.field("t.strings") == [f"token{i}" for i in range(5)]


def test_engines_of_one_model_share_its_tokenizer_until_its_files_change(tmp_path: Path):
    default = default_model_path()
    assert load_tokenizer(open_checkpoint(default)) is load_tokenizer(open_checkpoint(default))
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(default, copy)
    before = load_tokenizer(open_checkpoint(str(copy)))
    assert before is not load_tokenizer(open_checkpoint(default))  # another file: its own tokenizer
    assert load_tokenizer(open_checkpoint(str(copy))) is before
    os.utime(copy, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: read anew
    after = load_tokenizer(open_checkpoint(str(copy)))
    assert after is not before and after.encode("a kiln") == before.encode("a kiln")
