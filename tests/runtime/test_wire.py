"""The wire codec: exact round trips, zero-copy buffers, and only WireErrors from any bytes."""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from typing import Any

import hypothesis.extra.numpy as hnp
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.runtime import wire
from shoal.runtime.errors import FrameTooLarge, MalformedFrame, UnknownMessageType, WireError


@wire.message("test.point")
@dataclasses.dataclass
class Point:
    x: int
    label: str
    data: Any = None


class Color(enum.IntEnum):
    RED = 1


def same(a: Any, b: Any) -> bool:
    """Deep equality that compares arrays by dtype, shape and bits, and NaN equal to NaN."""
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and _tensor_bytes(a) == _tensor_bytes(b)
        )
    if isinstance(a, np.generic):
        return type(a) is type(b) and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return isinstance(b, float) and (a == b or (math.isnan(a) and math.isnan(b)))
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
        )
    if isinstance(a, Point):
        return isinstance(b, Point) and a.x == b.x and a.label == b.label and same(a.data, b.data)
    return type(a) is type(b) and a == b


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    if tensor.numel() == 0:
        return b""
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def roundtrip(value: Any, writable: bool = True) -> Any:
    frame = wire.encode(value)
    data = b"".join(bytes(part) for part in frame.parts)
    assert len(data) == frame.nbytes
    return wire.decode(bytearray(data) if writable else data)


numpy_dtypes = st.sampled_from(sorted(wire.NUMPY_DTYPES)).map(np.dtype)
arrays = numpy_dtypes.flatmap(
    lambda dtype: hnp.arrays(
        dtype, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
    )
)
tensors = st.sampled_from(sorted(wire.TORCH_DTYPES)).flatmap(
    lambda name: hnp.arrays(
        np.dtype(wire.TORCH_DTYPES[name]),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    ).map(lambda array, name=name: _tensor(array, name))
)


def _tensor(array: np.ndarray, name: str) -> torch.Tensor:
    tensor = torch.from_numpy(array.copy())
    return tensor.view(torch.bfloat16) if name == "bfloat16" else tensor


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(),
    st.binary(),
    arrays,
    tensors,
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=5), children, max_size=4),
        st.builds(Point, st.integers(-5, 5), st.text(max_size=3), children),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_decode_of_encode_is_identity(value: Any) -> None:
    assert same(value, roundtrip(value))


@settings(max_examples=100, deadline=None)
@given(arrays)
def test_read_only_frames_still_decode(array: np.ndarray) -> None:
    assert same(array, roundtrip(array, writable=False))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_wire_errors(data: bytes) -> None:
    try:
        wire.decode(data)
    except WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(values, st.data())
def test_corrupted_frames_raise_only_wire_errors(value: Any, data: st.DataObject) -> None:
    frame = bytearray(b"".join(bytes(part) for part in wire.encode(value).parts))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(frame) - 1))
        frame[index] = data.draw(st.integers(0, 255))
    try:
        wire.decode(frame)
    except WireError:
        pass


def test_array_memory_goes_to_the_socket_without_a_copy() -> None:
    array = np.arange(1000, dtype=np.float32)
    parts = wire.encode({"obs": array}).parts
    views = [part for part in parts if isinstance(part, memoryview)]
    assert len(views) == 1
    assert np.shares_memory(np.frombuffer(views[0], dtype=np.float32), array)


def test_tensor_memory_goes_to_the_socket_without_a_copy() -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    (view,) = [part for part in wire.encode(tensor).parts if isinstance(part, memoryview)]
    assert np.frombuffer(view, dtype=np.float32).ctypes.data == tensor.data_ptr()


def test_decoded_array_shares_the_received_buffer() -> None:
    received = bytearray(b"".join(bytes(p) for p in wire.encode(np.ones(64, np.float64)).parts))
    array = wire.decode(received)
    assert array.flags.writeable
    assert np.shares_memory(array, np.frombuffer(received, dtype=np.uint8))


def test_buffers_are_aligned_for_any_dtype() -> None:
    frame = b"".join(
        bytes(p) for p in wire.encode([b"x" * 3, np.ones(3, np.int8), np.ones(5)]).parts
    )
    decoded = wire.decode(bytearray(frame))
    base = np.frombuffer(bytearray(frame), np.uint8)
    assert decoded[1].dtype == np.int8
    assert decoded[2].sum() == 5
    assert len(base) == len(frame)


def test_non_contiguous_and_grad_tensors_are_sent_by_value() -> None:
    matrix = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert same(np.ascontiguousarray(matrix.T), roundtrip(matrix.T))
    weights = torch.ones(3, requires_grad=True)
    assert torch.equal(roundtrip(weights), torch.ones(3))


def test_subclasses_of_plain_types_travel_as_their_base() -> None:
    assert roundtrip({"c": Color.RED}) == {"c": 1}
    assert same(roundtrip(np.float32(1.5)), np.float32(1.5))


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (object(), "builtins.object"),
        ({1, 2}, "builtins.set"),
        (np.array([object()]), "'|O'"),
        (np.arange(3, dtype=">f4"), "'>f4'"),
        (torch.zeros(2, dtype=torch.complex64), "complex64"),
        (2**64, "cannot encode"),
        ([Exception("x")], "Exception"),
    ],
)
def test_values_that_cannot_cross_are_refused_on_encode(value: Any, needle: str) -> None:
    with pytest.raises(UnknownMessageType, match=needle.replace("|", r"\|")):
        wire.encode(value)


def test_unregistered_dataclass_is_refused() -> None:
    @dataclasses.dataclass
    class Secret:
        x: int

    with pytest.raises(UnknownMessageType, match=r"@wire\.message"):
        wire.encode(Secret(1))


def test_registration_rejects_non_dataclasses_and_taken_names() -> None:
    with pytest.raises(TypeError, match="dataclass"):
        wire.message("test.nope")(int)

    @dataclasses.dataclass
    class Other:
        x: int

    with pytest.raises(ValueError, match="already used"):
        wire.message("test.point")(Other)


def _frame_with_header(header: bytes, buffers: tuple[bytes, ...] = ()) -> bytes:
    """A hand-built frame, to send what a hostile or broken peer would."""
    head = struct.pack(f"<{len(buffers)}Q", *(len(b) for b in buffers)) + header
    body = bytearray(head)
    offset = wire.PREFIX_SIZE + len(head)
    for buf in buffers:
        pad = (-offset) % wire.ALIGN
        body += bytes(pad) + buf
        offset += pad + len(buf)
    return wire.PREFIX.pack(wire.MAGIC, len(header), len(buffers), offset) + bytes(body)


def test_unknown_message_name_on_decode() -> None:
    header = msgpack.packb(msgpack.ExtType(3, msgpack.packb(["evil.type", {}])))
    with pytest.raises(UnknownMessageType, match=r"evil\.type"):
        wire.decode(_frame_with_header(header))


def test_unknown_dtype_on_decode() -> None:
    header = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["|O", [1], 0])))
    with pytest.raises(UnknownMessageType, match="allow-list"):
        wire.decode(_frame_with_header(header, (b"12345678",)))


def test_shape_that_disagrees_with_the_buffer_on_decode() -> None:
    header = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<f4", [3], 0])))
    with pytest.raises(MalformedFrame, match="needs 12 bytes"):
        wire.decode(_frame_with_header(header, (b"12345678",)))


def test_unused_or_reused_buffers_on_decode() -> None:
    with pytest.raises(MalformedFrame, match="uses 0"):
        wire.decode(_frame_with_header(msgpack.packb(None), (b"x",)))
    ref = msgpack.ExtType(1, msgpack.packb(["|u1", [1], 0]))
    with pytest.raises(MalformedFrame, match="reused"):
        wire.decode(_frame_with_header(msgpack.packb([ref, ref]), (b"x",)))


def test_unknown_extension_type_on_decode() -> None:
    with pytest.raises(UnknownMessageType, match="extension type 42"):
        wire.decode(_frame_with_header(msgpack.packb(msgpack.ExtType(42, b"\xc0"))))


def test_frame_too_large_on_encode_and_before_allocating_on_decode() -> None:
    with pytest.raises(FrameTooLarge, match="exceeds the limit of 1000"):
        wire.encode(np.zeros(1000), max_frame_bytes=1000)
    prefix = wire.PREFIX.pack(wire.MAGIC, 0, 0, 10**12)
    with pytest.raises(FrameTooLarge, match="over the limit"):
        wire.frame_length(prefix)


def test_wrong_magic_and_truncation_are_malformed() -> None:
    frame = b"".join(bytes(p) for p in wire.encode([1, 2, 3]).parts)
    with pytest.raises(MalformedFrame, match="magic"):
        wire.decode(b"HTTP" + frame[4:])
    with pytest.raises(MalformedFrame, match="arrived"):
        wire.decode(frame[:-1])
    with pytest.raises(MalformedFrame, match="prefix needs"):
        wire.frame_length(frame[:5])


@settings(max_examples=200, deadline=None)
@given(st.lists(values, min_size=1, max_size=4), st.data())
def test_frame_reader_reassembles_a_stream_cut_anywhere(
    items: list[Any], data: st.DataObject
) -> None:
    stream = b"".join(bytes(p) for item in items for p in wire.encode(item).parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    reader = wire.FrameReader()
    frames: list[bytearray] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)]):
        frames += reader.feed(stream[start:end])
    assert not reader.mid_frame
    assert len(frames) == len(items)
    assert all(same(item, wire.decode(frame)) for item, frame in zip(items, frames))


def test_frame_reader_refuses_an_oversized_frame_before_allocating() -> None:
    reader = wire.FrameReader(max_frame_bytes=1024)
    with pytest.raises(FrameTooLarge):
        reader.feed(wire.PREFIX.pack(wire.MAGIC, 0, 0, 2**40))


def test_frame_reader_knows_when_it_is_mid_frame() -> None:
    stream = b"".join(bytes(p) for p in wire.encode(np.zeros(100)).parts)
    reader = wire.FrameReader()
    assert reader.feed(stream[:30]) == []
    assert reader.mid_frame
    assert len(reader.feed(stream[30:])) == 1


def test_a_state_dict_and_parameters_cross_as_plain_tensors() -> None:
    layer = torch.nn.Linear(4, 3)
    back = roundtrip({"weights": layer.state_dict(), "param": layer.weight})
    assert list(back["weights"]) == ["weight", "bias"]
    assert torch.equal(back["weights"]["bias"], layer.bias.detach())
    assert type(back["param"]) is torch.Tensor
    assert torch.equal(back["param"], layer.weight.detach())


def test_the_reused_encoder_recovers_from_a_value_it_could_not_encode() -> None:
    with pytest.raises(UnknownMessageType):
        wire.encode(["ok", np.zeros(3), object()])
    value = ["after", (1, 2), np.arange(4, dtype=np.int32)]
    assert same(roundtrip(value), value)
    assert len(wire.encode(["small"]).parts) == 1  # no buffers left over from the failure


def test_threads_encoding_at_once_get_their_own_frames() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def encode_decode(n: int) -> Any:
        value = [n, np.full(n + 1, n, dtype=np.int64), ("t", n)]
        return roundtrip(value)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(encode_decode, range(200)))
    for n, result in enumerate(results):
        assert same(result, [n, np.full(n + 1, n, dtype=np.int64), ("t", n)])
