"""The protobuf encoding of the bridge's bulk messages (PutFrame and GetFrame of proto/kv_bridge.proto),
written and read here rather than by the protobuf runtime: the runtime copies a bytes field into the
message when it is set or parsed and out again when it is read or serialized, copies of every chunk
byte that this codec does not make. A message is built as head + data + tail (one join of the data's
views), and parsed into views of the received bytes.

Encoding: what the protobuf runtime writes for the same message (fields in number order, proto3
defaults left out). Decoding: the rules a conforming parser applies (fields in any order; for a
repeated scalar the last wins, a repeated message field is merged, a oneof keeps its last member;
unknown fields and known numbers of another wire type are skipped; strings are strict UTF-8), except
that groups (a deprecated wire type the bridge never sends) make a message undecodable. A message
that does not decode raises DecodeError; `safe` turns that into an Undecodable value for gRPC
deserializers, which must not raise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5

PUT_FRAME = "flashpd.kvbridge.v1.PutFrame"
GET_FRAME = "flashpd.kvbridge.v1.GetFrame"


class DecodeError(ValueError):
    """Bytes that are not a valid encoding of the message."""


@dataclass(slots=True)
class ShmRef:
    name: str = ""
    length: int = 0
    arena_pid: int = 0  # set: an arena handle (kv_bridge.proto's ShmHandle), not a segment
    arena_fd: int = 0
    arena_inode: int = 0
    arena_size: int = 0
    offset: int = 0
    hold_ms: int = 0
    gen_offset: int = 0
    gen: int = 0


@dataclass(slots=True)
class Frame:
    """A ChunkFrame; `data` is a view of the received message (it keeps the message alive)."""

    key: str = ""
    offset: int = 0
    total_length: int = 0
    data: bytes | memoryview = b""
    last: bool = False
    shm: ShmRef | None = None  # set when the message has the field (even empty), as HasField("shm")


@dataclass(slots=True)
class FrameMessage:
    """A PutFrame or GetFrame: `frame` None when absent; `done` (GetDone.found) when a GetFrame holds done."""

    version: int = 0
    frame: Frame | None = None
    done: int | None = None


class Undecodable:
    """What a safe decoder returns for bytes that do not decode; the reason is capped (it may travel
    back in a status, whose size is limited)."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.type_name = type_name
        self.reason = str(error)[:64]


# -- encoding ----------------------------------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def frame_envelope(version: int, key: bytes, offset: int, total: int, data_len: int, last: bool) -> tuple[bytes, bytes]:
    """(head, tail) of a PutFrame or GetFrame (both hold the ChunkFrame in field 2) carrying data_len
    bytes of one chunk: head + data + tail is the serialized message."""
    inner = [b"\x0a" + _varint(len(key)) + key if key else b"",
             b"\x10" + _varint(offset) if offset else b"",
             b"\x18" + _varint(total) if total else b"",
             b"\x22" + _varint(data_len) if data_len else b""]
    inner_head = b"".join(inner)
    tail = b"\x28\x01" if last else b""
    outer = (b"\x08" + _varint(version) if version else b"") + b"\x12" + _varint(len(inner_head) + data_len + len(tail))
    return outer + inner_head, tail


# -- decoding ----------------------------------------------------------------------------------------
MAX_FIELDS = 64  # fields a message (at any level) may hold: a PutFrame or GetFrame uses at most 10


def _read_varint(b: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise DecodeError("truncated varint")
        byte = b[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & _U64, pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def _fields(b: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(number, wire type, value, end) of each field in b[pos:end]: for a length-delimited field value
    is where its payload starts and end where it ends; otherwise value is the number. More than MAX_FIELDS
    fields in one message is refused: a valid frame has at most a dozen, and a 32 MiB message of 2-byte fields
    cost the bridge 7-8 s of CPU in this loop before any check could refuse it."""
    count = 0
    while pos < end:
        count += 1
        if count > MAX_FIELDS:
            raise DecodeError(f"more than {MAX_FIELDS} fields in one message")
        tag, pos = _read_varint(b, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0 or tag > _U32:
            raise DecodeError("invalid field number")
        if wire == _VARINT:
            value, pos = _read_varint(b, pos, end)
            yield number, wire, value, pos
        elif wire == _LEN:
            n, pos = _read_varint(b, pos, end)
            if n > end - pos:
                raise DecodeError("truncated length-delimited field")
            yield number, wire, pos, pos + n
            pos += n
        elif wire in (_I64, _I32):
            size = 8 if wire == _I64 else 4
            if size > end - pos:
                raise DecodeError("truncated fixed-width field")
            yield number, wire, int.from_bytes(b[pos:pos + size], "little"), pos + size
            pos += size
        else:
            raise DecodeError(f"wire type {wire} is not accepted")


def _text(raw: memoryview) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        raise DecodeError("string field is not valid UTF-8") from None


def _merge_shm(ref: ShmRef, b: memoryview, pos: int, end: int) -> None:
    for number, wire, value, stop in _fields(b, pos, end):
        if number == 1 and wire == _LEN:
            ref.name = _text(b[value:stop])
        elif number == 2 and wire == _VARINT:
            ref.length = value
        elif 3 <= number <= 10 and wire == _VARINT:
            setattr(ref, _SHM_ARENA_FIELDS[number], value)


_SHM_ARENA_FIELDS = {3: "arena_pid", 4: "arena_fd", 5: "arena_inode", 6: "arena_size", 7: "offset", 8: "hold_ms",
                     9: "gen_offset", 10: "gen"}


def _merge_frame(f: Frame, b: memoryview, pos: int, end: int) -> None:
    for number, wire, value, stop in _fields(b, pos, end):
        if number == 1 and wire == _LEN:
            f.key = _text(b[value:stop])
        elif number == 2 and wire == _VARINT:
            f.offset = value
        elif number == 3 and wire == _VARINT:
            f.total_length = value
        elif number == 4 and wire == _LEN:
            f.data = b[value:stop]
        elif number == 5 and wire == _VARINT:
            f.last = value != 0
        elif number == 6 and wire == _LEN:
            if f.shm is None:
                f.shm = ShmRef()
            _merge_shm(f.shm, b, value, stop)


def decode_put_frame(data: bytes) -> FrameMessage:
    b = memoryview(data).cast("B")
    msg = FrameMessage()
    for number, wire, value, stop in _fields(b, 0, len(b)):
        if number == 1 and wire == _VARINT:
            msg.version = value & _U32
        elif number == 2 and wire == _LEN:
            if msg.frame is None:
                msg.frame = Frame()
            _merge_frame(msg.frame, b, value, stop)
    return msg


def decode_get_frame(data: bytes) -> FrameMessage:
    b = memoryview(data).cast("B")
    msg = FrameMessage()
    for number, wire, value, stop in _fields(b, 0, len(b)):
        if number == 1 and wire == _VARINT:
            msg.version = value & _U32
        elif number == 2 and wire == _LEN:  # oneof item: switching members clears the other
            if msg.frame is None:
                msg.frame, msg.done = Frame(), None
            _merge_frame(msg.frame, b, value, stop)
        elif number == 3 and wire == _LEN:
            if msg.done is None:
                msg.frame, msg.done = None, 0
            for n, w, v, _ in _fields(b, value, stop):
                if n == 1 and w == _VARINT:
                    msg.done = v & _U32
    return msg


def safe(decode: Callable[[bytes], FrameMessage], type_name: str) -> Callable[[bytes], FrameMessage | Undecodable]:
    """`decode` that returns an Undecodable instead of raising (a gRPC deserializer must not raise)."""

    def parse(data: bytes) -> FrameMessage | Undecodable:
        try:
            return decode(data)
        except DecodeError as e:
            return Undecodable(type_name, e)

    return parse
