from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INLINE: _ClassVar[Transport]
    SHM: _ClassVar[Transport]
INLINE: Transport
SHM: Transport

class ShmHandle(_message.Message):
    __slots__ = ("name", "length", "arena_pid", "arena_fd", "arena_inode", "arena_size", "offset", "hold_ms", "gen_offset", "gen")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ARENA_PID_FIELD_NUMBER: _ClassVar[int]
    ARENA_FD_FIELD_NUMBER: _ClassVar[int]
    ARENA_INODE_FIELD_NUMBER: _ClassVar[int]
    ARENA_SIZE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    GEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    length: int
    arena_pid: int
    arena_fd: int
    arena_inode: int
    arena_size: int
    offset: int
    hold_ms: int
    gen_offset: int
    gen: int
    def __init__(self, name: _Optional[str] = ..., length: _Optional[int] = ..., arena_pid: _Optional[int] = ..., arena_fd: _Optional[int] = ..., arena_inode: _Optional[int] = ..., arena_size: _Optional[int] = ..., offset: _Optional[int] = ..., hold_ms: _Optional[int] = ..., gen_offset: _Optional[int] = ..., gen: _Optional[int] = ...) -> None: ...

class ChunkFrame(_message.Message):
    __slots__ = ("key", "offset", "total_length", "data", "last", "shm")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    total_length: int
    data: bytes
    last: bool
    shm: ShmHandle
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., total_length: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., shm: _Optional[_Union[ShmHandle, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("version", "keys")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    version: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("version", "hits")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    version: int
    hits: int
    def __init__(self, version: _Optional[int] = ..., hits: _Optional[int] = ...) -> None: ...

class PutFrame(_message.Message):
    __slots__ = ("version", "frame")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    version: int
    frame: ChunkFrame
    def __init__(self, version: _Optional[int] = ..., frame: _Optional[_Union[ChunkFrame, _Mapping]] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("version", "stored", "duplicates", "refused", "refused_keys", "incomplete_keys")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_KEYS_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_KEYS_FIELD_NUMBER: _ClassVar[int]
    version: int
    stored: int
    duplicates: int
    refused: int
    refused_keys: _containers.RepeatedScalarFieldContainer[str]
    incomplete_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., refused: _Optional[int] = ..., refused_keys: _Optional[_Iterable[str]] = ..., incomplete_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("version", "keys", "transport", "frame_bytes", "arena")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    version: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    transport: Transport
    frame_bytes: int
    arena: bool
    def __init__(self, version: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., transport: _Optional[_Union[Transport, str]] = ..., frame_bytes: _Optional[int] = ..., arena: _Optional[bool] = ...) -> None: ...

class GetDone(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: int
    def __init__(self, found: _Optional[int] = ...) -> None: ...

class GetFrame(_message.Message):
    __slots__ = ("version", "frame", "done")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    version: int
    frame: ChunkFrame
    done: GetDone
    def __init__(self, version: _Optional[int] = ..., frame: _Optional[_Union[ChunkFrame, _Mapping]] = ..., done: _Optional[_Union[GetDone, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("version", "counters", "store")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    version: int
    counters: _containers.ScalarMap[str, int]
    store: str
    def __init__(self, version: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., store: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("version", "serving", "store")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    version: int
    serving: bool
    store: str
    def __init__(self, version: _Optional[int] = ..., serving: _Optional[bool] = ..., store: _Optional[str] = ...) -> None: ...
