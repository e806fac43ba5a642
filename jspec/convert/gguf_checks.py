"""A GGUF file checked before and while jspec reads it: its layout against its size, its
metadata against the types jspec needs.

`gguf.GGUFReader` trusts every count it reads: a metadata array that claims 2**62 items makes it
loop with memory growing on a file of a few bytes, a tensor's dimensions multiply (in uint64,
wrapping) into a size its data need not have, a truncated file gives views that are merely
short. `check_layout` walks the header, the metadata and the tensor directory with `struct`,
bounding each count by the bytes left before it loops, so the reader only ever sees files whose
every part lies inside them. `Metadata` hands out values of the type asked for, or says which key
is missing or of another type.
"""

from __future__ import annotations

import mmap
import os
import struct

import gguf

from jspec.errors import JspecError

_SUPPORTED_VERSIONS = (2, 3)
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays of ...: llama.cpp writes none deeper than two
_ARRAY, _STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
# Bytes of each scalar value type, and struct's letter for the few the walk reads.
_SCALAR_BYTES = {gguf.GGUFValueType.UINT8: 1, gguf.GGUFValueType.INT8: 1, gguf.GGUFValueType.BOOL: 1,
                 gguf.GGUFValueType.UINT16: 2, gguf.GGUFValueType.INT16: 2, gguf.GGUFValueType.UINT32: 4,
                 gguf.GGUFValueType.INT32: 4, gguf.GGUFValueType.FLOAT32: 4, gguf.GGUFValueType.UINT64: 8,
                 gguf.GGUFValueType.INT64: 8, gguf.GGUFValueType.FLOAT64: 8}
# The fewest bytes one item of a type takes: what bounds an array's count by the bytes left.
_LEAST_BYTES = {**_SCALAR_BYTES, _STRING: 8, _ARRAY: 12}
_INTS = {t for t in _SCALAR_BYTES if t.name.startswith(("UINT", "INT"))}
_FLOATS = {gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64}


def _unreadable(path, what: str) -> JspecError:
    return JspecError(f"'{path}' is not a readable GGUF file: {what}")


class _Cursor:
    """Reads a mapped file front to back, refusing any read past its end."""

    def __init__(self, data, path, order: str):
        self.data, self.path, self.order, self.at = data, path, order, 0

    def left(self) -> int:
        return len(self.data) - self.at

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            raise _unreadable(self.path, f"it ends inside {what} (a truncated or damaged file)")
        self.at += n

    def take(self, n: int, what: str) -> bytes:
        self.skip(n, what)
        return self.data[self.at - n:self.at]

    def number(self, letter: str, what: str) -> int | float:
        return struct.unpack(self.order + letter, self.take(struct.calcsize(letter), what))[0]

    def text(self, what: str) -> str:
        length = self.number("Q", what)
        try:
            return self.take(length, what).decode("utf-8")
        except UnicodeDecodeError:
            raise _unreadable(self.path, f"{what} is not UTF-8 text") from None

    def count(self, per_item: int, what: str) -> int:
        """An item count, refused if its items could not fit in the bytes left."""
        n = self.number("Q", what)
        if n * per_item > self.left():
            raise _unreadable(self.path, f"{what} claims {n} items, more than the {self.left()} bytes left could hold")
        return n


def check_layout(path: str) -> None:
    """Refuse, in one line naming the file, a GGUF file whose header, metadata or tensor directory
    does not lie inside it, or whose tensors' data does not: what `gguf.GGUFReader` could not
    parse, would loop on, or would read short. Costs one pass over the metadata (a tenth of a
    second for a 50,000-token vocabulary); tensor data is not read."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size < 24:  # magic, version, two counts
                raise _unreadable(path, f"it has {size} bytes, fewer than a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _check_mapped(data, path, size)
    except FileNotFoundError:
        raise JspecError(f"GGUF file '{path}' not found") from None
    except OSError as e:
        raise JspecError(f"cannot read GGUF file '{path}': {e.strerror or e}") from None


def _check_mapped(data: mmap.mmap, path: str, size: int) -> None:
    if data[:4] != b"GGUF":
        raise _unreadable(path, "it does not start with the GGUF magic")
    # A file written on a big-endian machine reads as a version with low 16 bits zero.
    order = ">" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF == 0 else "<"
    cursor = _Cursor(data, path, order)
    cursor.skip(4, "the magic")
    version = cursor.number("I", "the version")
    if version not in _SUPPORTED_VERSIONS:
        raise _unreadable(path, f"GGUF version {version} (jspec reads versions 2 and 3)")
    tensor_count = cursor.number("Q", "the tensor count")
    kv_count = cursor.count(8 + 4 + 1, "the metadata")  # key length, type, one byte at least
    if tensor_count * (8 + 4 + 4 + 8) > cursor.left():
        raise _unreadable(path, f"it claims {tensor_count} tensors, more than the file could describe")
    alignment, keys = gguf.GGUF_DEFAULT_ALIGNMENT, set()
    for _ in range(kv_count):
        key = cursor.text("a metadata key")
        if key in keys:
            raise _unreadable(path, f"metadata {key!r} appears twice")
        keys.add(key)
        kind = _value_type(cursor, key)
        if key == "general.alignment":
            if kind != gguf.GGUFValueType.UINT32:
                raise _unreadable(path, "general.alignment is not a uint32")
            alignment = cursor.number("I", key)
            if alignment == 0 or alignment & (alignment - 1):
                raise _unreadable(path, f"general.alignment {alignment} is not a power of two")
        else:
            _skip_value(cursor, kind, key, 0)
    tensors = [_tensor_info(cursor, i) for i in range(tensor_count)]
    start = -(-cursor.at // alignment) * alignment
    _check_tensors(tensors, path, start, size)


def _value_type(cursor: _Cursor, key: str) -> gguf.GGUFValueType:
    raw = cursor.number("I", f"the type of metadata {key!r}")
    try:
        return gguf.GGUFValueType(raw)
    except ValueError:
        raise _unreadable(cursor.path, f"metadata {key!r} has unknown type {raw}") from None


def _skip_value(cursor: _Cursor, kind: gguf.GGUFValueType, key: str, depth: int) -> None:
    what = f"metadata {key!r}"
    if kind in _SCALAR_BYTES:
        cursor.skip(_SCALAR_BYTES[kind], what)
    elif kind == _STRING:
        cursor.text(what)
    else:
        if depth >= _MAX_NESTING:
            raise _unreadable(cursor.path, f"{what} nests arrays more than {_MAX_NESTING} deep")
        item = _value_type(cursor, key)
        n = cursor.count(_LEAST_BYTES[item], what)
        if item in _SCALAR_BYTES:
            cursor.skip(n * _SCALAR_BYTES[item], what)
        else:
            for _ in range(n):
                _skip_value(cursor, item, key, depth + 1)


def _tensor_info(cursor: _Cursor, index: int) -> tuple[str, list[int], int, int]:
    """(name, dims innermost first, ggml type, offset in the data) of one tensor's entry."""
    name = cursor.text(f"the name of tensor {index}")
    n_dims = cursor.number("I", f"tensor {name}")
    if n_dims > _MAX_DIMS:
        raise _unreadable(cursor.path, f"tensor {name} has {n_dims} dimensions (ggml has at most {_MAX_DIMS})")
    dims = [cursor.number("Q", f"tensor {name}") for _ in range(n_dims)]
    return name, dims, cursor.number("I", f"tensor {name}"), cursor.number("Q", f"tensor {name}")


def _check_tensors(tensors: list[tuple[str, list[int], int, int]], path: str, start: int, size: int) -> None:
    names = set()
    for name, dims, raw_type, offset in tensors:
        if name in names:
            raise _unreadable(path, f"tensor {name} appears twice")
        names.add(name)
        try:
            kind = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise _unreadable(path, f"tensor {name} has unknown type {raw_type}") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        if dims and dims[0] % block:
            raise _unreadable(path, f"tensor {name} has rows of {dims[0]} values, not whole {kind.name} blocks")
        elements = 1
        for n in dims:
            elements *= n  # Python integers: no wrapping, however absurd the dimensions
        end = start + offset + elements // block * block_bytes
        if end > size:
            raise _unreadable(path, f"tensor {name} (dimensions {dims}) has data past the end of the file "
                                    f"(to byte {end} of {size}: a truncated or damaged file)")


class Metadata:
    """A parsed GGUF file's metadata, each value checked against the type asked for: "int",
    "float" (an integer is taken too), "bool", "str", or "list" of any of them."""

    def __init__(self, reader: gguf.GGUFReader, path: str | None = None):
        self.reader, self.path = reader, path or getattr(reader.data, "filename", "the GGUF file")

    def get(self, key: str, kind: str, default=None):
        """The value of `key` (None or `default` when absent), or a JspecError naming the key."""
        field = self.reader.get_field(key)
        if field is None:
            return default
        types = field.types
        item = types[-1] if types and types[0] == _ARRAY else None
        scalar = {"int": _INTS, "float": _INTS | _FLOATS, "bool": {gguf.GGUFValueType.BOOL}, "str": {_STRING}}
        if kind.startswith("list"):
            element = kind.removeprefix("list[").removesuffix("]")
            ok = types[:1] == [_ARRAY] and (len(types) == 1 or (len(types) == 2 and item in scalar[element]))
        else:
            ok = len(types) == 1 and types[0] in scalar[kind]
        if not ok:
            shown = "/".join(t.name.lower() for t in types) or "nothing"
            raise JspecError(f"GGUF file '{self.path}': metadata {key!r} is {shown}; jspec expects {kind}")
        try:
            value = field.contents()
        except UnicodeDecodeError:
            raise JspecError(f"GGUF file '{self.path}': metadata {key!r} is not UTF-8 text") from None
        return float(value) if kind == "float" else value

    def require(self, key: str, kind: str):
        """The value of `key`, or a JspecError saying the file lacks it."""
        value = self.get(key, kind)
        if value is None:
            raise JspecError(f"GGUF file '{self.path}' lacks metadata {key!r}, which jspec needs")
        return value
