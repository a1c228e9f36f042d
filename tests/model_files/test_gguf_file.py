"""Folio's GGUF header reader against gguf-py's own GGUFReader."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from tests.worker.gguf_factory import TinyModelSpec, write_tiny_gguf
from model_files.gguf_file import GGUFFile, GGUFFormatError


def _write_all_value_types(path):
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.25)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo 🙂")
    writer.add_array("t.strs", ["a", "", "ĠĠ", "日本"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_custom_alignment(64)
    writer.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b", np.ones((3, 32), dtype=np.float16))
    writer.add_tensor("c", np.zeros((1, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()


def _reader_value(field):
    if field.types[0] == GGUFValueType.ARRAY:
        return list(field.contents())
    return field.contents()


def test_metadata_matches_gguf_reader(tmp_path):
    _write_all_value_types(tmp_path / "all.gguf")
    ours = GGUFFile(tmp_path / "all.gguf")
    reader = GGUFReader(tmp_path / "all.gguf")
    expected = {name: _reader_value(field) for name, field in reader.fields.items()
                if not name.startswith("GGUF.")}
    assert set(ours.metadata) == set(expected)
    for key, value in expected.items():
        mine = ours.metadata[key]
        mine = mine.tolist() if isinstance(mine, np.ndarray) else mine
        assert mine == pytest.approx(value) if isinstance(value, float) else mine == value, key
    assert ours.metadata["t.str"] == "héllo 🙂" and ours.metadata["t.u64"] == 2**63 + 5
    assert ours.version == 3 and ours.architecture == "llama"


def test_tensor_directory_matches_gguf_reader(tmp_path):
    _write_all_value_types(tmp_path / "all.gguf")
    write_tiny_gguf(tmp_path / "tiny.gguf", TinyModelSpec(arch="qwen2"))
    for path in (tmp_path / "all.gguf", tmp_path / "tiny.gguf"):
        ours = GGUFFile(path)
        reader = GGUFReader(path)
        assert list(ours.tensors) == [t.name for t in reader.tensors]
        for tensor in reader.tensors:
            info = ours.tensors[tensor.name]
            assert info.ggml_type == tensor.tensor_type
            assert info.shape == tuple(int(d) for d in reversed(tensor.shape))
            assert info.offset == tensor.data_offset and info.num_bytes == tensor.n_bytes
            assert np.array_equal(ours.raw_tensor(tensor.name), tensor.data)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(GGUFFormatError, match="magic"):
        GGUFFile(tmp_path / "x.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFFormatError):
        GGUFFile(tmp_path / "empty.gguf")


def test_truncated_file_is_reported(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "header_cut.gguf").write_bytes(data[:200])
    with pytest.raises(GGUFFormatError, match="truncated|past the end"):
        GGUFFile(tmp_path / "header_cut.gguf")
    (tmp_path / "data_cut.gguf").write_bytes(data[:-100])
    with pytest.raises(GGUFFormatError, match="past the end"):
        GGUFFile(tmp_path / "data_cut.gguf")


def test_default_model_header_reads_fast(default_model_path):
    import time

    started = time.perf_counter()
    gguf = GGUFFile(default_model_path)
    elapsed = time.perf_counter() - started
    assert len(gguf.metadata["tokenizer.ggml.tokens"]) == 49152
    assert len(gguf.metadata["tokenizer.ggml.merges"]) == 48900
    assert len(gguf.tensors) == 272
    assert elapsed < 3.0  # GGUFReader takes ~7 s here; this reader ~0.25 s
