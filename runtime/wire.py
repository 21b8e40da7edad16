"""The byte format of one message between processes: a fixed prefix, a msgpack header and
out-of-band raw buffers for arrays and tensors.

Arrays travel beside the header, not inside it, so the sender hands the array's own memory to
the socket (no copy) and the receiver builds the array on the received bytes. Nothing is ever
pickled: only msgpack values, tuples, numpy arrays and scalars, torch tensors and dataclasses
registered with `@message("stable-name")` can cross, and the decoder validates every dtype,
shape, length and offset, and bounds the header's nesting and size before unpacking it
(wire_shape.py), so a hostile peer can only ever cause a `WireError`.

Layout (little-endian): magic "SHL1", u32 header length, u32 buffer count, u64 frame length,
one u64 length per buffer, the header, then each buffer starting on a 64-byte boundary.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import numpy as np

from shoal.runtime.errors import FrameTooLarge, MalformedFrame, UnknownMessageType, WireError
from shoal.runtime.wire_shape import check_shape

MAGIC = b"SHL1"
PREFIX = struct.Struct("<4sIIQ")
PREFIX_SIZE = PREFIX.size
ALIGN = 64
MAX_BUFFERS = 1 << 16
MAX_NDIM = 32
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024

_EXT_NDARRAY = 1
_EXT_TENSOR = 2
_EXT_MESSAGE = 3
_EXT_TUPLE = 4
_EXT_NPSCALAR = 5

# Little-endian or single-byte dtypes only: a frame means the same bytes on every host.
NUMPY_DTYPES = frozenset(
    [
        "|b1",
        "|i1",
        "|u1",
        "<i2",
        "<u2",
        "<i4",
        "<u4",
        "<i8",
        "<u8",
        "<f2",
        "<f4",
        "<f8",
        "<c8",
        "<c16",
    ]
)
# torch dtype name -> the numpy dtype that carries its bytes (bfloat16 travels as raw int16).
TORCH_DTYPES: dict[str, str] = {
    "bool": "|b1",
    "int8": "|i1",
    "uint8": "|u1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "float16": "<f2",
    "bfloat16": "<i2",
    "float32": "<f4",
    "float64": "<f8",
}

Buffer = bytes | bytearray | memoryview

T = TypeVar("T")

_MESSAGES: dict[str, type] = {}
_MESSAGE_NAMES: dict[type, str] = {}


class EncodedFrame:
    """The pieces to write in order (the arrays' own memory among them) and their total size.

    A slotted class, not a NamedTuple: one is built per message sent, and a NamedTuple costs
    twice as much to build."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: list[Buffer], nbytes: int) -> None:
        self.parts = parts
        self.nbytes = nbytes


def message(name: str) -> Callable[[type[T]], type[T]]:
    """Register a dataclass to cross the wire under `name`; the name, not the Python path, is
    what a peer sees, so classes can move between modules without breaking old peers."""

    def register(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"@wire.message({name!r}) needs a dataclass, got {cls!r}")
        known = _MESSAGES.get(name)
        # The same class imported twice (a reload) may re-register; another class may not.
        if known is not None and _origin(known) != _origin(cls):
            raise ValueError(f"wire message name {name!r} is already used by {known!r}")
        _MESSAGES[name] = cls
        _MESSAGE_NAMES[cls] = name
        return cls

    return register


def _origin(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _raw_bytes(array: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array: the socket reads the array's own memory."""
    return array.reshape(-1).view(np.uint8).data


class _Encoder:
    """Collects the out-of-band buffers while msgpack walks the value.

    One per thread is kept and reused (`_encoder()`): building a msgpack Packer per message
    costs several times packing a small one. The reusable Packer packs the top-level value
    only; ext payloads (arrays, tuples, messages) are packed inside its `default` callback,
    while it is busy, so they use `packb`."""

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.busy = False
        self._packer = msgpack.Packer(default=self.default, use_bin_type=True, strict_types=True)

    def pack_top(self, value: Any) -> bytes:
        return self._packer.pack(value)

    def pack(self, value: Any) -> bytes:
        return msgpack.packb(value, default=self.default, use_bin_type=True, strict_types=True)

    def default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return msgpack.ExtType(_EXT_NDARRAY, self.pack(self._array(obj)))
        if isinstance(obj, np.generic):
            dtype = _checked_numpy_dtype(obj.dtype)
            return msgpack.ExtType(_EXT_NPSCALAR, self.pack([dtype, obj.tobytes()]))
        if isinstance(obj, tuple):
            return msgpack.ExtType(_EXT_TUPLE, self.pack(list(obj)))
        if isinstance(obj, bool | int | float | str | bytes | list | dict):
            return self._plain(obj)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return msgpack.ExtType(_EXT_TENSOR, self.pack(self._tensor(obj)))
        name = _MESSAGE_NAMES.get(type(obj))
        if name is not None:
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
            return msgpack.ExtType(_EXT_MESSAGE, self.pack([name, fields]))
        raise UnknownMessageType(
            f"cannot send a {type(obj).__module__}.{type(obj).__qualname__}: only msgpack values, "
            "tuples, numpy arrays, torch tensors and dataclasses registered with "
            "@wire.message('name') cross processes; convert it or register it"
        )

    @staticmethod
    def _plain(obj: Any) -> Any:
        """Subclasses of plain types (IntEnum, OrderedDict, ...) travel as their base type;
        msgpack packs what `default` returns."""
        bases: tuple[type[Any], ...] = (bool, int, float, str, bytes, list, dict)
        for base in bases:
            if isinstance(obj, base):
                return base(obj)
        raise TypeError(f"{type(obj)!r} is not a subclass of a plain type")

    def _array(self, array: np.ndarray) -> list[Any]:
        dtype = _checked_numpy_dtype(array.dtype)
        return [dtype, list(array.shape), self._add(np.ascontiguousarray(array))]

    def _tensor(self, tensor: Any) -> list[Any]:
        torch = sys.modules["torch"]
        name = str(tensor.dtype).removeprefix("torch.")
        if name not in TORCH_DTYPES or tensor.layout != torch.strided:
            raise UnknownMessageType(
                f"cannot send a {tensor.layout} tensor of dtype {tensor.dtype}: allowed dtypes are "
                f"{sorted(TORCH_DTYPES)} with the strided layout; convert it first"
            )
        tensor = tensor.detach().cpu().contiguous()
        if name == "bfloat16":
            tensor = tensor.view(torch.int16)
        return [name, list(tensor.shape), self._add(tensor.numpy())]

    def _add(self, array: np.ndarray) -> int:
        self.buffers.append(_raw_bytes(array))
        return len(self.buffers) - 1


def _checked_numpy_dtype(dtype: np.dtype) -> str:
    if dtype.str not in NUMPY_DTYPES:
        raise UnknownMessageType(
            f"cannot send numpy dtype {dtype.str!r}: allowed dtypes are {sorted(NUMPY_DTYPES)}; "
            "convert with .astype() (big-endian to little-endian, objects to numbers)"
        )
    return dtype.str


_local = threading.local()


def _encoder() -> _Encoder:
    """This thread's reusable encoder, or a fresh one if encoding re-entered (a message field
    whose getter sends something)."""
    encoder: _Encoder | None = getattr(_local, "encoder", None)
    if encoder is None or encoder.busy:
        encoder = _Encoder()
        if getattr(_local, "encoder", None) is None:
            _local.encoder = encoder
    return encoder


def encode(value: Any, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> EncodedFrame:
    """Encode `value` into frame parts; raises `UnknownMessageType` or `FrameTooLarge` before
    anything is written, so a sender learns of its own mistake and the link stays healthy."""
    encoder = _encoder()
    encoder.busy = True
    try:
        header = encoder.pack_top(value)
    except WireError:
        _local.encoder = None  # a packer that failed mid-value is not trusted again
        raise
    except (OverflowError, ValueError, TypeError, RecursionError) as exc:
        _local.encoder = None
        raise UnknownMessageType(f"cannot encode the value: {exc}") from exc
    finally:
        encoder.busy = False
        buffers = encoder.buffers
        if buffers:
            encoder.buffers = []
    if not buffers:  # the common small message: one part, no table, no padding
        total = PREFIX_SIZE + len(header)
        if total > max_frame_bytes:
            raise FrameTooLarge(
                f"a frame of {total} bytes exceeds the limit of {max_frame_bytes} bytes; "
                "send the data in smaller pieces or raise max_frame_bytes on both ends"
            )
        return EncodedFrame([PREFIX.pack(MAGIC, len(header), 0, total) + header], total)
    head_len = PREFIX_SIZE + 8 * len(buffers) + len(header)
    offset = head_len
    pads: list[int] = []
    for buf in buffers:
        start = _aligned(offset)
        pads.append(start - offset)
        offset = start + buf.nbytes
    if offset > max_frame_bytes:
        raise FrameTooLarge(
            f"a frame of {offset} bytes exceeds the limit of {max_frame_bytes} bytes; "
            "send the data in smaller pieces or raise max_frame_bytes on both ends"
        )
    head = b"".join(
        [
            PREFIX.pack(MAGIC, len(header), len(buffers), offset),
            struct.pack(f"<{len(buffers)}Q", *(buf.nbytes for buf in buffers)),
            header,
        ]
    )
    parts: list[Buffer] = [head]
    for pad, buf in zip(pads, buffers):
        if pad:
            parts.append(bytes(pad))
        parts.append(buf)
    return EncodedFrame(parts, offset)


def frame_length(prefix: Buffer, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """The whole frame's size read from its first PREFIX_SIZE bytes, checked against the limit
    so a receiver never allocates for a frame it would refuse."""
    if len(prefix) < PREFIX_SIZE:
        raise MalformedFrame(f"a frame prefix needs {PREFIX_SIZE} bytes, got {len(prefix)}")
    magic, header_len, count, total = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise MalformedFrame(
            f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}: not a shoal peer"
        )
    if total > max_frame_bytes:
        raise FrameTooLarge(
            f"the peer sent a frame of {total} bytes, over the limit of {max_frame_bytes} bytes"
        )
    if count > MAX_BUFFERS or PREFIX_SIZE + 8 * count + header_len > total:
        raise MalformedFrame(
            f"frame prefix is inconsistent: {count} buffers and a {header_len}-byte header "
            f"do not fit in {total} bytes"
        )
    return int(total)


def decode(frame: Buffer, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
    """Decode one whole frame. Arrays and tensors share memory with `frame` when it is
    writable (a bytearray); from read-only bytes tensors are copied, arrays stay read-only."""
    view = memoryview(frame).cast("B") if isinstance(frame, memoryview) else memoryview(frame)
    total = frame_length(view, max_frame_bytes)
    if total != len(view):
        raise MalformedFrame(f"frame says it is {total} bytes long but {len(view)} arrived")
    _, header_len, count, _ = PREFIX.unpack_from(view)
    if not count:  # the common small frame: no buffer table, nothing to track
        if PREFIX_SIZE + header_len != total:
            raise MalformedFrame(
                f"frame has {total - PREFIX_SIZE - header_len} trailing bytes after its header"
            )
        return _unpack(_NO_BUFFERS, view[PREFIX_SIZE:total])
    lengths = struct.unpack_from(f"<{count}Q", view, PREFIX_SIZE)
    header_start = PREFIX_SIZE + 8 * count
    offset = header_start + header_len
    buffers: list[memoryview] = []
    for length in lengths:
        start = _aligned(offset)
        offset = start + length
        if offset > total:
            raise MalformedFrame(
                f"buffer of {length} bytes at {start} runs past the frame end {total}"
            )
        buffers.append(view[start:offset])
    if offset != total:
        raise MalformedFrame(f"frame has {total - offset} trailing bytes after its last buffer")
    decoder = _Decoder(buffers)
    value = _unpack(decoder, view[header_start : header_start + header_len])
    if len(decoder.used) != count:
        raise MalformedFrame(
            f"frame carries {count} buffers but its header uses {len(decoder.used)}"
        )
    return value


def _unpack(decoder: _Decoder, header: memoryview) -> Any:
    check_shape(header)
    try:
        return decoder.unpack(header)
    except WireError:
        raise
    except Exception as exc:
        raise MalformedFrame(f"frame header is not valid: {type(exc).__name__}: {exc}") from exc


class _Decoder:
    """Turns ext values back into arrays, tensors, tuples and messages, each buffer used once."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers
        self.used: set[int] = set()

    def unpack(self, data: Buffer) -> Any:
        return msgpack.unpackb(
            data, ext_hook=self.ext_hook, raw=False, strict_map_key=False, use_list=True
        )

    def ext_hook(self, code: int, data: bytes) -> Any:
        payload = self.unpack(data)
        if code == _EXT_NDARRAY:
            return self._array(payload)
        if code == _EXT_TENSOR:
            return self._tensor(payload)
        if code == _EXT_MESSAGE:
            return self._message(payload)
        if code == _EXT_TUPLE and isinstance(payload, list):
            return tuple(payload)
        if code == _EXT_NPSCALAR:
            return self._scalar(payload)
        raise UnknownMessageType(
            f"frame carries unknown extension type {code}: peer is incompatible"
        )

    def _take(self, dtype: str, shape: Any, index: Any) -> np.ndarray:
        if dtype not in NUMPY_DTYPES:
            raise UnknownMessageType(
                f"peer sent an array of dtype {dtype!r}, not in the allow-list"
            )
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in shape)
        ):
            raise MalformedFrame(f"array shape {shape!r} is not a list of at most {MAX_NDIM} sizes")
        if type(index) is not int or not 0 <= index < len(self.buffers) or index in self.used:
            raise MalformedFrame(f"array refers to buffer {index!r}, which is missing or reused")
        self.used.add(index)
        buf = self.buffers[index]
        itemsize = np.dtype(dtype).itemsize
        count = 1
        for n in shape:
            count *= n
        if count * itemsize != buf.nbytes:
            raise MalformedFrame(
                f"array of shape {shape} and dtype {dtype} needs {count * itemsize} bytes, "
                f"its buffer has {buf.nbytes}"
            )
        return np.frombuffer(buf, dtype=dtype).reshape(shape)

    def _array(self, payload: Any) -> np.ndarray:
        if not isinstance(payload, list) or len(payload) != 3:
            raise MalformedFrame("an array entry must be [dtype, shape, buffer index]")
        return self._take(*payload)

    def _tensor(self, payload: Any) -> Any:
        if not isinstance(payload, list) or len(payload) != 3:
            raise MalformedFrame("a tensor entry must be [dtype, shape, buffer index]")
        name, shape, index = payload
        if name not in TORCH_DTYPES:
            raise UnknownMessageType(f"peer sent a tensor of dtype {name!r}, not in the allow-list")
        array = self._take(TORCH_DTYPES[name], shape, index)
        if not array.flags.writeable:
            array = array.copy()
        import torch

        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if name == "bfloat16" else tensor

    def _message(self, payload: Any) -> Any:
        if not isinstance(payload, list) or len(payload) != 2 or not isinstance(payload[1], dict):
            raise MalformedFrame("a message entry must be [name, {field: value}]")
        name, fields = payload
        cls = _MESSAGES.get(name) if isinstance(name, str) else None
        if cls is None:
            raise UnknownMessageType(
                f"peer sent message type {name!r}, which is not registered here; both ends must "
                "import the module that declares it with @wire.message"
            )
        try:
            return cls(**{str(key): value for key, value in fields.items()})
        except TypeError as exc:
            raise MalformedFrame(f"message {name!r} has the wrong fields: {exc}") from exc

    def _scalar(self, payload: Any) -> Any:
        if not isinstance(payload, list) or len(payload) != 2 or not isinstance(payload[1], bytes):
            raise MalformedFrame("a numpy scalar entry must be [dtype, raw bytes]")
        dtype, raw = payload
        if dtype not in NUMPY_DTYPES:
            raise UnknownMessageType(
                f"peer sent a scalar of dtype {dtype!r}, not in the allow-list"
            )
        if len(raw) != np.dtype(dtype).itemsize:
            raise MalformedFrame(
                f"a {dtype} scalar needs {np.dtype(dtype).itemsize} bytes, got {len(raw)}"
            )
        return np.frombuffer(raw, dtype=dtype)[0]


class FrameReader:
    """Reassembles whole frames from a byte stream cut at arbitrary points (websocket messages).

    Each frame gets its own writable buffer sized from its prefix, after the size limit is
    checked, so a hostile length costs an error, never an allocation."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._max = max_frame_bytes
        self._head = bytearray()
        self._frame: bytearray | None = None
        self._filled = 0

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame has arrived and the rest is still missing."""
        return bool(self._head) or self._frame is not None

    def feed(self, data: Buffer) -> list[bytearray]:
        """Take the next piece of the stream; return the frames it completed, in order."""
        view = memoryview(data)
        done: list[bytearray] = []
        while view:
            frame = self._frame
            if frame is None and not self._head and len(view) >= PREFIX_SIZE:
                total = frame_length(view, self._max)
                if len(view) >= total:  # a whole frame in hand: one copy, nothing to track
                    done.append(bytearray(view[:total]))
                    view = view[total:]
                    continue
            if frame is None:
                need = PREFIX_SIZE - len(self._head)
                self._head += view[:need]
                view = view[need:]
                if len(self._head) < PREFIX_SIZE:
                    break
                frame = self._frame = bytearray(frame_length(self._head, self._max))
                frame[:PREFIX_SIZE] = self._head
                self._filled = PREFIX_SIZE
                self._head.clear()
            take = min(len(view), len(frame) - self._filled)
            frame[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == len(frame):
                done.append(frame)
                self._frame = None
        return done


# Shared by every frame without buffers: it holds no state then (an array entry in such a
# frame names a missing buffer and fails before anything is recorded).
_NO_BUFFERS = _Decoder([])
