"""Pickle protocol 5 with out-of-band buffers: plain CPU torch tensors and numpy arrays
travel as raw bytes after the stream, and come back as writable arrays sharing one copy."""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ...errors import DecodeError, EncodeError

OOB_HEAD = struct.Struct("<QI")
ONE_LENGTH = struct.Struct("<Q")
ALIGN = 16  # enough for every numpy / torch dtype; the allocator gives >= 16
ZEROS = bytes(ALIGN)
# Exact types that never produce out-of-band buffers nor need the tensor reducer.
ATOMIC = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray})

#: ``bytes`` values of at least this size are pickled by `bytes_stream` (no copy)
BIG_BYTES = 64 << 10


def bytes_stream(data: bytes, protocol: int) -> list[bytes]:
    """The pickle stream of a ``bytes`` value as parts, the value itself one of them:
    ``pickle.dumps`` would copy it into its stream, and the codec then copies the stream
    once more when it joins header and payload. ``PROTO``, ``BINBYTES8`` (protocol 4+),
    the bytes, ``STOP``: a stream every unpickler of protocol 4 or later reads as
    ``data`` (no frame: framing is optional)."""
    return [b"\x80%c\x8e%b" % (protocol, struct.pack("<Q", len(data))), data, b"."]


def rebuild_tensor(buf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """Unpickle side of `reduce_tensor()`: a tensor sharing (not copying) ``buf``."""
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise DecodeError(f"unknown torch dtype {dtype!r}")
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if mv.readonly:  # only when pickled in-band by someone else: copy, never warn
        buf = bytearray(buf)
    flat = torch.frombuffer(buf, dtype=torch_dtype)
    if len(shape) == 1 and len(flat) == shape[0]:
        return flat  # (a reshape to what it is costs more than the rest together)
    return flat.reshape(shape)


#: numpy dtype kinds `reduce_array()` takes: bool, ints, floats, complex (a dtype of these
#: is all its ``str`` says; structured, object, string and datetime dtypes are not)
ARRAY_KINDS = frozenset("biufc")


def rebuild_array(buf: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    """Unpickle side of `reduce_array()`: an array over ``buf`` (not a copy of it).

    numpy's own reduction rebuilds the dtype object from a pickled state on every load
    (~3 µs of a small array's ~6); a dtype string is looked up in numpy's cache."""
    import numpy as np

    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"unknown numpy dtype {dtype!r}") from exc
    if memoryview(buf).readonly:  # only when pickled in-band by someone else: copy
        buf = bytearray(buf)
    return np.frombuffer(buf, dt).reshape(shape)


def reduce_array(a: Any, protocol: int) -> Any:
    """Reduce an exact ``numpy.ndarray`` of a plain dtype to (PickleBuffer, dtype string,
    shape); anything else (subclasses, Fortran order kept, structured or object dtypes)
    is left to numpy's own reduction. A read-only array is reduced from a writable copy:
    pickle would mark its buffer read-only and decode would give a read-only array,
    which torch (``as_tensor``/``from_numpy``, hence ``default_collate``) warns about."""
    copied = not a.flags.writeable
    if copied:
        a = a.copy(order="K")
    if a.dtype.kind not in ARRAY_KINDS or not a.flags.c_contiguous:
        return a.__reduce_ex__(protocol) if copied else NotImplemented
    return rebuild_array, (pickle.PickleBuffer(a), a.dtype.str, a.shape)


def reduce_tensor(t: Any, torch: Any) -> Any:
    """Reduce a plain CPU tensor to (dtype, shape, PickleBuffer of its bytes).

    Returns NotImplemented (torch's own pickling) for anything whose meaning is more than
    its values: autograd state, subclasses, sparse/quantized/nested/non-CPU tensors.
    """
    if (
        t.requires_grad
        or t.layout is not torch.strided
        or t.device.type != "cpu"
        or t.is_quantized
        or t.is_nested
    ):
        return NotImplemented
    raw: Any = None
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        try:  # the common case: its memory as it is (~1 µs; the general way ~7)
            raw = t.numpy()
        except (RuntimeError, TypeError):  # numpy missing, or a dtype numpy lacks
            raw = None
    if raw is None:
        flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
        try:
            raw = flat.view(torch.uint8).numpy()
        except (RuntimeError, TypeError):  # numpy missing or an exotic dtype
            return NotImplemented
    dtype = str(t.dtype).removeprefix("torch.")
    return rebuild_tensor, (pickle.PickleBuffer(raw), dtype, tuple(t.shape))


class Pickler(pickle.Pickler):
    """C pickler with two reductions plain ``pickle.dumps`` cannot do.

    * plain CPU torch tensors go out-of-band (see `reduce_tensor()`);
    * numpy arrays of plain dtypes as their buffer, dtype string and shape (see
      `reduce_array()`: half the load time of numpy's own for a small array), read-only
      ones from a writable copy.
    """

    def __init__(self, protocol: int) -> None:
        self.file = io.BytesIO()
        self.buffers: list[pickle.PickleBuffer] = []
        super().__init__(self.file, protocol, buffer_callback=self.buffers.append)
        self.protocol = protocol
        self.torch: Any = None
        self.tensor_type: Any = None
        self.ndarray_type: Any = None

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is self.tensor_type:
            return reduce_tensor(obj, self.torch)
        if cls is self.ndarray_type:
            return reduce_array(obj, self.protocol)
        return NotImplemented


_local = threading.local()


def dumps_special(obj: object, protocol: int) -> tuple[bytes, list[Any]]:
    """pickle.dumps through `Pickler`, reusing one pickler per thread.

    Building a pickler + BytesIO costs ~1 µs, more than pickling a small value. The
    pickler is taken out of the thread-local while in use, so a re-entrant call (a
    ``__reduce__`` that encodes) gets its own, and one that failed mid-dump is dropped.
    """
    p: Pickler | None = _local.__dict__.pop("pickler", None)
    if p is None or p.protocol != protocol:
        p = Pickler(protocol)
    torch = sys.modules.get("torch")
    if p.torch is not torch or p.ndarray_type is None:  # a module was imported since
        p.torch = torch
        p.tensor_type = getattr(torch, "Tensor", None)
        p.ndarray_type = getattr(sys.modules.get("numpy"), "ndarray", None)
    p.clear_memo()  # cheap insurance: a stream must never refer to a previous dump's memo
    p.dump(obj)
    f = p.file
    stream = f.getvalue()
    f.seek(0)
    f.truncate()
    bufs: list[Any] = []
    if p.buffers:
        bufs = p.buffers.copy()
        p.buffers.clear()
    p.clear_memo()
    _local.pickler = p
    return stream, bufs


def oob_parts(stream: bytes, raws: Sequence[Any], head: int | None = None
              ) -> tuple[list[Any], int]:
    """(parts, total length) of an out-of-band payload: table, stream, aligned buffers.

    ``head``: the bytes that precede the payload in the stored value (header and tag).
    Given, the stream is followed by zeros so that the buffer region starts at a multiple
    of ``ALIGN`` from the value's start: a reader that received the value into memory of
    its own decodes the buffers as views of it, aligned (`split_oob()` with ``owned``).
    Only for pickle streams: ``pickle.loads`` ignores what follows the stream's STOP.
    """
    lengths = [memoryview(r).nbytes for r in raws]
    stream_len = len(stream)
    pad_stream = 0
    if head is not None:
        pad_stream = -(head + OOB_HEAD.size + 8 * len(raws) + stream_len) % ALIGN
    table = (OOB_HEAD.pack(stream_len + pad_stream, len(raws))
             + struct.pack(f"<{len(raws)}Q", *lengths))
    parts: list[Any] = [table, stream]
    if pad_stream:
        parts.append(ZEROS[:pad_stream])
    pos = 0
    for raw, n in zip(raws, lengths, strict=True):
        pad = -pos % ALIGN
        if pad:
            parts.append(ZEROS[:pad])
            pos += pad
        parts.append(raw)
        pos += n
    return parts, len(table) + stream_len + pad_stream + pos


def split_oob(payload: bytes | memoryview, owned_at: int | None = None
              ) -> tuple[bytes | memoryview, list[memoryview]]:
    """(stream, buffers) of an out-of-band payload.

    Every count and length is checked against the payload size before it is used, so a
    forged table cannot make ``struct`` or the span list allocate more than the input.
    The buffers are slices of one writable region owning no other copy: the payload's
    own bytes when ``owned_at`` is given (the payload is a writable view of memory that
    belongs to this one value and is never reused; ``owned_at`` is the payload's offset
    in it) and its buffer region starts ``ALIGN``-aligned there; else one fresh
    ``bytearray`` (the region copied exactly once).
    """
    total = len(payload)
    if total < OOB_HEAD.size:
        raise DecodeError("truncated buffer table")
    stream_len, nbuf = OOB_HEAD.unpack_from(payload)
    table_end = OOB_HEAD.size + 8 * nbuf
    if table_end > total:
        raise DecodeError(
            f"buffer table claims {nbuf} buffers, more than a {total}-byte payload can hold"
        )
    region_start = table_end + stream_len
    if region_start > total:
        raise DecodeError("truncated out-of-band value")
    if nbuf == 1:  # most values: one array or tensor (no span list to build)
        if ONE_LENGTH.unpack_from(payload, OOB_HEAD.size)[0] != total - region_start:
            raise DecodeError("out-of-band buffer sizes do not match the value length")
        return payload[table_end:region_start], [_region(payload, region_start, owned_at)]
    lengths = struct.unpack_from(f"<{nbuf}Q", payload, OOB_HEAD.size)
    spans = []
    pos = 0
    for n in lengths:
        pos += -pos % ALIGN
        spans.append((pos, pos + n))
        pos += n
    if pos != total - region_start:
        raise DecodeError("out-of-band buffer sizes do not match the value length")
    region = _region(payload, region_start, owned_at)
    return payload[table_end:region_start], [region[a:b] for a, b in spans]


def _region(payload: bytes | memoryview, start: int, owned_at: int | None) -> memoryview:
    """The buffers' region: a view of the value's own memory where `split_oob` may use it
    (owned, and aligned there), else its one copy."""
    if owned_at is not None and (owned_at + start) % ALIGN == 0:
        return memoryview(payload)[start:]
    return memoryview(bytearray(memoryview(payload)[start:]))


#: copyreg extension codes of the two reconstructors (PEP 307's range for third parties):
#: a stream names each in 2 bytes instead of its module path, and a load finds it in a
#: dict instead of importing it by name (about half the load time of a small array).
#: Streams that name them either way load alike; a code another library took first is
#: left to it, and this process then pickles the reconstructor by name.
EXTENSION_CODES = {"rebuild_array": 224, "rebuild_tensor": 225}


def _register_extensions() -> None:
    for name, code in EXTENSION_CODES.items():
        try:
            copyreg.add_extension(__name__, name, code)
        except ValueError:  # the code or the name is registered otherwise
            continue


_register_extensions()


def encode_error(obj: object, exc: BaseException) -> EncodeError:
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    return EncodeError(
        f"cannot encode a value of type {name}: {exc}. Make it picklable "
        "(no lambdas, locks, open files or sockets; define __reduce__/__getstate__) "
        "or pass a custom codec (codec=...)."
    )


def unpickle_error(exc: Exception) -> DecodeError:
    return DecodeError(f"cannot unpickle value: {type(exc).__name__}: {exc}")
