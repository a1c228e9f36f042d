"""A GGUF file's header (metadata and tensor directory) and zero-copy views of its tensors.

Why not ``gguf.GGUFReader``: it wraps every string of the tokenizer vocabulary in its own
numpy memmap view, which costs about 7 s for SmolLM2's 49k tokens and 49k merges on two
cores, on every start of every process that reads the model (worker and API alike).
This reader walks the same format with ``struct`` in well under a second and keeps the
``gguf`` package for what it does well: enum names, block sizes and dequantisation.
It needs numpy but not torch, so the API process may import it for the tokenizer.

File layout (little-endian, version 2 or 3)::

    "GGUF" u32 version | u64 n_tensors | u64 n_kv
    n_kv    × ( string key | u32 value_type | value )
    n_tensors × ( string name | u32 n_dims | u64 dims[n_dims] | u32 ggml_type | u64 offset )
    padding to `general.alignment` (default 32)
    tensor data; each tensor's `offset` is relative to the start of this section

A string is ``u64 length | utf-8 bytes``; an array is ``u32 item_type | u64 count | items``.
``dims`` lists the fastest-varying dimension first, the reverse of numpy/torch order.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}
_NUMPY_DTYPES: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"), GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"), GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"), GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.UINT64: np.dtype("<u8"), GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT32: np.dtype("<f4"), GGUFValueType.FLOAT64: np.dtype("<f8"),
    GGUFValueType.BOOL: np.dtype("?"),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (bad magic, truncated, ...)."""


@dataclass(slots=True, frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor directory.

    ``shape`` is in numpy/torch order (slowest dimension first), i.e. GGUF's dims reversed;
    for a matrix that is ``(out_features, in_features)``, as in a ``torch.nn.Linear``.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset of the first byte in the file
    num_bytes: int


class _Cursor:
    """Sequential little-endian decoding over a buffer; raises GGUFFormatError on overrun."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise GGUFFormatError(f"{self.path}: string runs past the end of the file")
        text = self.buf[self.pos:end].decode("utf-8")
        self.pos = end
        return text

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        return self.take(_SCALAR_FORMATS[kind])

    def array(self) -> list | np.ndarray:
        # Numeric arrays come back as numpy arrays (49k token types decode in microseconds);
        # string and nested arrays as lists.
        item_kind = GGUFValueType(self.take("<I"))
        count = self.take("<Q")
        if item_kind in _NUMPY_DTYPES:
            dtype = _NUMPY_DTYPES[item_kind]
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise GGUFFormatError(f"{self.path}: array runs past the end of the file")
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos = end
            return items
        return [self.value(item_kind) for _ in range(count)]


class GGUFFile:
    """A memory-mapped GGUF file: ``metadata`` (key → value) and ``tensors`` (name → info).

    Scalars decode to Python ints/floats/bools/strs, numeric arrays to numpy arrays and
    string arrays to lists of str. The mapping stays open for as long as the object or any
    array returned by :meth:`raw_tensor` is alive.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            try:
                self._buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file cannot be mapped
                raise GGUFFormatError(f"{self.path}: not a GGUF file ({exc})") from exc
        cursor = _Cursor(self._buf, self.path)
        self.version, num_tensors, num_kv = self._read_preamble(cursor)
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string()
            self.metadata[key] = cursor.value(GGUFValueType(cursor.take("<I")))
        directory = [self._read_tensor_entry(cursor) for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment  # round up to the alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, relative in directory:
            info = GGUFTensorInfo(name, shape, ggml_type, data_start + relative,
                                  _byte_count(shape, ggml_type))
            if info.offset + info.num_bytes > len(self._buf):
                raise GGUFFormatError(f"{self.path}: tensor {name!r} runs past the end of file")
            self.tensors[name] = info

    def _read_preamble(self, cursor: _Cursor) -> tuple[int, int, int]:
        if len(self._buf) < 24 or self._buf[:4] != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (bad magic)")
        cursor.pos = 4
        version = cursor.take("<I")
        if version not in (2, 3):
            hint = " (big-endian files are not supported)" if version > 0xFFFF else ""
            raise GGUFFormatError(f"{self.path}: unsupported GGUF version {version}{hint}")
        return version, cursor.take("<Q"), cursor.take("<Q")

    @staticmethod
    def _read_tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cursor.string()
        num_dims = cursor.take("<I")
        dims = [cursor.take("<Q") for _ in range(num_dims)]
        try:
            ggml_type = GGMLQuantizationType(cursor.take("<I"))
        except ValueError as exc:
            raise GGUFFormatError(f"{cursor.path}: tensor {name!r} has unknown type ({exc})") from exc
        return name, tuple(reversed(dims)), ggml_type, cursor.take("<Q")

    @property
    def architecture(self) -> str:
        """``general.architecture`` (e.g. "llama", "qwen2")."""
        return str(self.metadata.get("general.architecture", ""))

    def raw_tensor(self, name: str) -> np.ndarray:
        """Zero-copy view of a tensor's stored bytes, shaped the way ``gguf.quants`` expects.

        F32/F16/BF16 come back as a 2-byte or 4-byte typed array of ``info.shape``; block
        quantised types as uint8 of shape ``(*shape[:-1], bytes_per_row)``.
        """
        info = self.tensors[name]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.num_bytes, offset=info.offset)
        if info.ggml_type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(info.shape)
        if info.ggml_type == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(info.shape)
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        return raw.reshape(*info.shape[:-1], info.shape[-1] // block_size * type_size)


def _byte_count(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    num_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[-1] % block_size:
        raise GGUFFormatError(f"row of {shape[-1]} is not a whole number of "
                              f"{ggml_type.name} blocks ({block_size})")
    return num_elements // block_size * type_size
