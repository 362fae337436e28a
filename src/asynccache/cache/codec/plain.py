"""The pickle-free payload of ``Codec(allow_pickle=False)``: MessagePack plus raw buffers.

Decoding runs no code named by the stored bytes: MessagePack is a data-only format parsed
in C with every length bounded, and the few extension types (tuples, big ints, numpy
arrays and scalars, CPU torch tensors) are parsed here with explicit checks. Nothing in
this module imports or calls `pickle`. What is stored, and why MessagePack:
docs/formats.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

import msgpack

from asynccache._interrupts import raised_in_signal_handler
from asynccache.errors import DecodeError, EncodeError

__all__ = ["dumps", "loads"]

_EXT_TUPLE = 1
_EXT_NDARRAY = 2
_EXT_TENSOR = 3
_EXT_BIGINT = 4
_EXT_NPSCALAR = 5
_MARK = msgpack.ExtType(_EXT_TUPLE, b"")
_DESC = struct.Struct("<BBI")  # dtype code, ndim, buffer index; then ndim <Q dims
_MAX_NDIM = 64  # numpy's own limit
MAX_DEPTH = 1024  # nested containers, enforced by msgpack's packer and unpacker alike

# Codes are part of the stored format: append only, never reorder (code 0 is bool in both).
_NUMPY_DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip
_TORCH_DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)  # fmt: skip

_local = threading.local()


@functools.cache
def _numpy_tables() -> tuple[list[Any], dict[Any, int], dict[type, int]]:
    """(dtype per code, code per dtype, code per scalar type); numpy is imported lazily."""
    import numpy as np

    dtypes = [np.dtype(name).newbyteorder("<") for name in _NUMPY_DTYPES]
    codes = {dt: code for code, dt in enumerate(dtypes)}
    return dtypes, codes, {dt.type: code for code, dt in enumerate(dtypes)}


@functools.cache
def _torch_tables() -> tuple[list[Any], dict[Any, int]]:
    """(dtype per code, code per dtype); a dtype this torch build lacks keeps its code
    (None), so codes never shift."""
    import torch

    dtypes = [getattr(torch, name, None) for name in _TORCH_DTYPES]
    return dtypes, {dt: code for code, dt in enumerate(dtypes) if dt is not None}


# --------------------------------------------------------------------------- encode


_SUPPORTED = (
    "tensors, numpy arrays, bytes, str, int, float, bool, None and list/tuple/dict of them"
)


def _hint(obj: object) -> str:
    """How to turn an unsupported value into a supported one."""
    if type(obj).__module__.startswith("PIL.") and hasattr(obj, "getbands"):
        return "a PIL image: convert with numpy.asarray(img)"
    if dataclasses.is_dataclass(obj):
        return "a dataclass: turn it into a dict, e.g. dataclasses.asdict(value)"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return "a namedtuple: convert with tuple(value) or value._asdict()"
    for base, how in (
        (bool, "bool(value)"),
        (int, "int(value) (an enum: value.value)"),
        (float, "float(value)"),
        (str, "str(value)"),
        (bytes, "bytes(value)"),
        (bytearray, "bytes(value)"),
        (dict, "dict(value)"),
        (list, "list(value)"),
        (tuple, "tuple(value)"),
        (set, "sorted(value) or list(value)"),
        (frozenset, "sorted(value) or list(value)"),
        (complex, "[value.real, value.imag] or a numpy array"),
    ):
        if isinstance(obj, base):
            return f"convert with {how}"
    return "convert it to one of those (a dict of its fields, a numpy array, ...)"


def _unsupported(obj: object, advice: str | None = None) -> EncodeError:
    cls = type(obj)
    return EncodeError(
        f"allow_pickle=False cannot store a {cls.__module__}.{cls.__qualname__} "
        f"({advice or _hint(obj)}); it stores {_SUPPORTED}"
    )


class _Writer:
    """One thread's packer, plus the out-of-band buffers of the value being packed."""

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.packer = msgpack.Packer(
            default=self.default, strict_types=True, use_bin_type=True, autoreset=True
        )
        self.np: Any = sys.modules.get("numpy")
        self.torch: Any = sys.modules.get("torch")

    def default(self, obj: Any) -> Any:
        """Called by msgpack for every object it cannot pack itself (strict_types=True
        sends subclasses here too, so an IntEnum or OrderedDict is never silently
        flattened)."""
        cls = type(obj)
        if cls is tuple:
            return [_MARK, *obj]
        if cls is int:  # only reached for ints outside MessagePack's 64-bit range
            n = (obj.bit_length() + 8) // 8  # + the sign bit
            return msgpack.ExtType(_EXT_BIGINT, obj.to_bytes(n, "little", signed=True))
        if self.np is None or self.torch is None:  # imported since the writer was built
            self.np = sys.modules.get("numpy")
            self.torch = sys.modules.get("torch")
        np, torch = self.np, self.torch
        if np is not None:
            if cls is np.ndarray:
                return self.array(obj)
            if isinstance(obj, np.ndarray):
                raise _unsupported(obj, "an ndarray subclass: convert with numpy.asarray(value)")
            if isinstance(obj, np.generic):
                dtypes, _, scalar_codes = _numpy_tables()
                code = scalar_codes.get(cls)
                if code is None:
                    raise _unsupported(obj, "numpy scalars of bool and numeric dtypes only")
                raw = np.asarray(obj, dtype=dtypes[code]).tobytes()
                return msgpack.ExtType(_EXT_NPSCALAR, bytes([code]) + raw)
        if torch is not None and isinstance(obj, torch.Tensor):
            return self.tensor(obj, torch)
        raise _unsupported(obj)

    def _ref(self, ext: int, code: int, shape: tuple[int, ...], raw: memoryview) -> Any:
        index = len(self.buffers)
        self.buffers.append(raw)
        desc = _DESC.pack(code, len(shape), index) + struct.pack(f"<{len(shape)}Q", *shape)
        return msgpack.ExtType(ext, desc)

    def array(self, arr: Any) -> Any:
        np = self.np
        codes = _numpy_tables()[1]
        dt = arr.dtype
        if dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big"):
            dt = dt.newbyteorder("<")
        code = codes.get(dt)
        if code is None:
            raise _unsupported(
                arr,
                f"dtype {arr.dtype.str}: arrays of bool and numeric dtypes only; convert with "
                ".astype(...), or .tolist() for strings and objects",
            )
        flat = np.ascontiguousarray(arr, dtype=dt).reshape(-1)
        return self._ref(_EXT_NDARRAY, code, arr.shape, memoryview(flat.view(np.uint8)))

    def tensor(self, t: Any, torch: Any) -> Any:
        if type(t) is not torch.Tensor:
            raise _unsupported(
                t, "a Tensor subclass: convert with value.detach().as_subclass(torch.Tensor)"
            )
        fix = None
        if t.requires_grad:
            fix = "value.detach()"
        elif t.device.type != "cpu":
            fix = "value.cpu()"
        elif t.layout is not torch.strided:
            fix = "value.to_dense()"
        elif t.is_quantized:
            fix = "value.dequantize()"
        elif t.is_nested:
            fix = "value.unbind() (a list of tensors)"
        code = _torch_tables()[1].get(t.dtype)
        if code is None and fix is None:
            fix = "value.to(torch.float32) or another supported dtype"
        if fix is not None or code is None:  # (code is None: fix was set just above)
            raise _unsupported(t, f"plain CPU tensors only: convert with {fix}")
        if self.np is None:
            try:
                self.np = __import__("numpy")
            except ImportError as exc:
                raise EncodeError("allow_pickle=False needs numpy to store torch tensors") from exc
        raw = memoryview(b"")
        if t.numel():  # (an empty tensor may have a 0 stride, which view() refuses)
            flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
            raw = memoryview(flat.view(torch.uint8).numpy())
        return self._ref(_EXT_TENSOR, code, tuple(t.shape), raw)


def dumps(obj: object) -> tuple[bytes, list[memoryview]]:
    """(MessagePack stream, out-of-band buffers) for ``obj``; EncodeError if unsupported.

    One packer per thread (a Packer allocates its buffer on construction); it is taken
    out of the thread-local while in use and dropped after a failure, like the pickler.
    """
    w: _Writer | None = _local.__dict__.pop("writer", None)
    if w is None:
        w = _Writer()
    try:
        stream = w.packer.pack(obj)
    except EncodeError:
        raise
    except ValueError as exc:
        if "recursion limit" not in str(exc):
            raise _encode_failed(obj, exc) from exc
        raise EncodeError(
            f"value is nested deeper than {MAX_DEPTH} containers (or contains itself), "
            "which allow_pickle=False cannot store"
        ) from exc
    except Exception as exc:  # UnicodeEncodeError (lone surrogates), OverflowError, ...
        if raised_in_signal_handler(exc):
            raise
        raise _encode_failed(obj, exc) from exc
    buffers = w.buffers
    if buffers:
        w.buffers = []
    _local.writer = w
    return stream, buffers


def _encode_failed(obj: object, exc: Exception) -> EncodeError:
    return EncodeError(
        f"cannot encode a {type(obj).__qualname__} with allow_pickle=False: "
        f"{type(exc).__name__}: {exc}"
    )


# --------------------------------------------------------------------------- decode


class _Reader:
    """Per-decode state for msgpack's hooks: the buffers, which are used, open tuples."""

    __slots__ = ("buffers", "marks", "used")

    def __init__(self, buffers: Sequence[memoryview]) -> None:
        self.buffers = buffers
        self.used = bytearray(len(buffers))
        self.marks = 0  # tuple markers seen and not yet consumed by list_hook

    def ext(self, code: int, data: bytes) -> Any:
        if code == _EXT_TUPLE and not data:
            self.marks += 1
            return _MARK
        if code in (_EXT_NDARRAY, _EXT_TENSOR):
            return self.ref(code, data)
        if code == _EXT_BIGINT:
            return int.from_bytes(data, "little", signed=True)
        if code == _EXT_NPSCALAR and data:
            dtypes = _numpy_dtypes()
            dt = dtypes[data[0]] if data[0] < len(dtypes) else None
            if dt is None or len(data) != 1 + dt.itemsize:
                raise DecodeError("invalid numpy scalar")
            if dt.kind == "b":
                _check_bools(data[1:])
            return _import("numpy").frombuffer(data, dt, 1, 1)[0]
        raise DecodeError(f"unknown extension type {code} ({len(data)} bytes)")

    def ref(self, ext: int, data: bytes) -> Any:
        """An array or tensor over its out-of-band buffer; every field checked first."""
        if len(data) < _DESC.size:
            raise DecodeError("truncated array descriptor")
        code, ndim, index = _DESC.unpack_from(data)
        if ndim > _MAX_NDIM or len(data) != _DESC.size + 8 * ndim:
            raise DecodeError(f"invalid array descriptor ({ndim} dims in {len(data)} bytes)")
        if index >= len(self.buffers) or self.used[index]:
            raise DecodeError(f"array refers to buffer {index}: absent or already used")
        self.used[index] = 1
        shape = struct.unpack_from(f"<{ndim}Q", data, _DESC.size)
        dtypes = _numpy_dtypes() if ext == _EXT_NDARRAY else _torch_dtypes()
        dt = dtypes[code] if code < len(dtypes) else None
        if dt is None:
            raise DecodeError(f"unknown dtype code {code}")
        buf = self.buffers[index]
        itemsize = dt.itemsize
        if math.prod(shape) * itemsize != len(buf):  # Python ints: no overflow
            raise DecodeError(f"shape {shape} of {dt} does not match its {len(buf)}-byte buffer")
        if code == 0:  # bool in both tables
            _check_bools(buf)
        if ext == _EXT_NDARRAY:
            return _import("numpy").frombuffer(buf, dt).reshape(shape)
        torch = _import("torch")
        if not len(buf):
            return torch.empty(shape, dtype=dt)
        return torch.frombuffer(buf, dtype=dt).reshape(shape)

    def array(self, items: list[Any]) -> Any:
        if items and items[0] is _MARK:
            self.marks -= 1
            del items[0]
            return tuple(items)
        return items


def _check_bools(raw: bytes | memoryview) -> None:
    """Bool values must be bytes 0 or 1: numpy and torch kernels assume it (one copy of
    the buffer, for bool arrays only)."""
    if bytes(raw).translate(None, b"\x00\x01"):
        raise DecodeError("bool values other than 0 and 1")


def _import(name: str) -> Any:
    module = sys.modules.get(name)
    if module is None:
        try:
            module = __import__(name)
        except ImportError as exc:
            raise DecodeError(f"value holds {name} data but {name} is not installed") from exc
    return module


def _numpy_dtypes() -> list[Any]:
    _import("numpy")
    return _numpy_tables()[0]


def _torch_dtypes() -> list[Any]:
    _import("torch")
    return _torch_tables()[0]


def loads(stream: bytes | memoryview, buffers: Sequence[memoryview] = ()) -> object:
    """Inverse of `dumps()`: DecodeError for anything `dumps()` cannot produce.

    ``buffers`` must be writable (the arrays and tensors returned are views of them).
    """
    r = _Reader(buffers)
    try:
        out = msgpack.unpackb(
            stream,
            ext_hook=r.ext,
            list_hook=r.array,
            strict_map_key=False,  # int, float, None, bytes, tuple keys
            timestamp=2,  # ext -1, never written: an int, not a Timestamp object
        )
    except DecodeError:
        raise
    except msgpack.StackError as exc:
        raise DecodeError(f"value is nested deeper than {MAX_DEPTH} containers") from exc
    except Exception as exc:  # FormatError, ExtraData, ValueError, TypeError (unhashable)
        if raised_in_signal_handler(exc):
            raise
        raise DecodeError(f"invalid pickle-free value: {type(exc).__name__}: {exc}") from exc
    if r.marks:
        raise DecodeError("invalid pickle-free value: a tuple marker outside a tuple")
    if len(buffers) and not all(r.used):
        raise DecodeError("invalid pickle-free value: a buffer no array refers to")
    return out
