"""A GGUF file's metadata and tensor table, read with struct from a memory map; the tensors as numpy views of the
file, laid out as gguf's GGUFReader lays them out (gguf.ReaderTensor). GGUFReader makes a numpy view of every
element of every metadata array: 16 s (31 s on a busy machine) for a synthetic 262k-token vocabulary (tokens, scores,
types), paid on every start; this reads that file in 0.5 s and a 98-tensor tiny-qwen2 in 0.03 s instead of 1.1 s,
with the same values and the same arrays. It also names what is wrong with a damaged file
(GGUFReader says "When changing to a larger dtype ...", "cannot reshape array ...", "index 0 is out of bounds"):
where it ends early, and which tensor is cut off, or which value cannot be."""
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8
# read past, not decoded: transformers builds the tokenizer from the file itself (a BPE file holds ~150k-500k merges)
SKIPPED = ("tokenizer.ggml.merges",)
# ggml types stored as plain values, and their numpy types; every other type is blocks of bytes
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class Field:
    """A metadata value, with GGUFReader's ReaderField.contents() (engine/gguf_hparams.py reads either)."""

    def __init__(self, value):
        self.value = value

    def contents(self, index_or_slice: int | slice = slice(None)):
        return self.value[index_or_slice] if isinstance(self.value, list) else self.value


@dataclass
class GGUFFile:
    fields: dict[str, Field]       # metadata key -> value (the GGUF.* header values too, as GGUFReader has them)
    tensors: list                  # gguf.ReaderTensor, in the file's order


class _Ends(Exception):
    """The file ended before the value being read."""


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Ends
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def raw(self, size: int) -> bytes:
        if self.pos + size > len(self.buf):
            raise _Ends
        self.pos += size
        return self.buf[self.pos - size:self.pos]

    def string(self) -> str:
        return self.raw(self.take("<Q")).decode("utf-8", errors="replace")


def read_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensors; ValueError naming the file and what is wrong with it."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty (0 bytes): a failed or unfinished download? Download it again")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        fields, table, data_start = _layout(_Cursor(buf), path, size)
    return GGUFFile(fields, _tensors(path, table, data_start, size))


def _layout(r: _Cursor, path: Path, size: int) -> tuple[dict, list, int]:
    truncated = f"{path} is truncated or corrupt ({size} bytes)"
    magic = r.buf[:4]
    if magic != b"GGUF"[:len(magic)]:
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        r.raw(4)
        version, num_tensors, num_kv = r.take("<I"), r.take("<Q"), r.take("<Q")
    except _Ends:
        raise ValueError(f"{path} is truncated ({size} bytes): it ends inside the GGUF header") from None
    if version not in (2, 3):
        raise ValueError(f"{path} is corrupt, big-endian or of an unknown GGUF version ({version}; this reader "
                         "knows little-endian versions 2 and 3)")
    fields = {"GGUF.version": Field(version), "GGUF.tensor_count": Field(num_tensors),
              "GGUF.kv_count": Field(num_kv)}
    key = None
    try:
        for i in range(num_kv):
            key = None
            key = r.string()
            fields[key] = Field(_value(r, r.take("<I"), key, path, decode=key not in SKIPPED))
    except _Ends:
        where = f"key {key!r}" if key is not None else f"key #{i + 1} of {num_kv}"
        raise ValueError(f"{truncated}: its metadata runs past the end of the file ({where})") from None
    table, name = [], None
    try:
        for i in range(num_tensors):
            name = None
            name = r.string()
            n_dims = r.take("<I")
            if n_dims > _MAX_DIMS:
                raise ValueError(f"{path} is corrupt: tensor {name!r} has {n_dims} dimensions")
            dims = [r.take("<Q") for _ in range(n_dims)]
            table.append((name, dims, r.take("<I"), r.take("<Q")))
    except _Ends:
        where = f"tensor {name!r}" if name is not None else f"tensor #{i + 1} of {num_tensors}"
        raise ValueError(f"{truncated}: its tensor table runs past the end of the file ({where})") from None
    alignment = fields["general.alignment"].value if "general.alignment" in fields else 32
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path} is corrupt: general.alignment {alignment!r} is not a power of two")
    return fields, table, -(-r.pos // alignment) * alignment


def _value(r: _Cursor, kind: int, key: str, path: Path, decode: bool = True):
    if kind in _SCALARS:
        return r.take(_SCALARS[kind])
    if kind == _STRING:
        return r.string()
    if kind != _ARRAY:
        raise ValueError(f"{path} is corrupt: metadata key {key!r} has unknown value type {kind}")
    item, count = r.take("<I"), r.take("<Q")
    if item in _SCALARS:
        width = struct.calcsize(_SCALARS[item])
        values = r.raw(width * count)
        return np.frombuffer(values, dtype=np.dtype(_SCALARS[item])).tolist() if decode else None
    if item == _STRING:
        out = []
        for _ in range(count):
            text = r.raw(r.take("<Q"))
            if decode:
                out.append(text.decode("utf-8", errors="replace"))
        return out if decode else None
    raise ValueError(f"{path} is corrupt: metadata key {key!r} holds an array of unknown value type {item}")


def _tensors(path: Path, table: list, data_start: int, size: int) -> list:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape
    sized, expected = [], data_start
    for name, dims, type_id, offset in table:
        try:
            ggml_type = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise ValueError(f"{path} is corrupt: tensor {name!r} has unknown type {type_id}") from None
        n_elements = math.prod(dims)
        n_bytes = n_elements * type_size // block
        sized.append((name, dims, ggml_type, data_start + offset, n_elements, n_bytes))
        expected = max(expected, data_start + offset + n_bytes)
    cut = [t for t in sized if t[3] + t[5] > size]
    if cut:
        first = min(cut, key=lambda t: t[3])
        raise ValueError(f"{path} is truncated: {size} of its {expected} bytes are there, so tensor {first[0]!r} and "
                         "any after it are cut off; a failed or unfinished download? Download it again")
    data = np.memmap(path, mode="r")
    tensors, seen = [], set()
    for name, dims, ggml_type, start, n_elements, n_bytes in sized:
        if name in seen:
            raise ValueError(f"{path} is corrupt: it holds tensor {name!r} twice")
        seen.add(name)
        shape = tuple(reversed(dims))
        if ggml_type.value in _PLAIN:
            array = data[start:start + n_bytes].view(_PLAIN[ggml_type.value]).reshape(shape)
        else:
            array = data[start:start + n_bytes].reshape(quant_shape_to_byte_shape(shape, ggml_type))
        tensors.append(ReaderTensor(name=name, tensor_type=ggml_type, shape=np.array(dims, dtype=np.uint64),
                                    n_elements=n_elements, n_bytes=n_bytes, data_offset=start, data=array,
                                    field=None))
    return tensors
