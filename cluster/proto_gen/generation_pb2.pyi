from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("version", "prompt_text", "prompt_ids", "max_tokens", "method", "block_size", "temperature", "top_p", "top_k", "seed", "ignore_eos")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    version: int
    prompt_text: str
    prompt_ids: TokenIds
    max_tokens: int
    method: str
    block_size: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    def __init__(self, version: _Optional[int] = ..., prompt_text: _Optional[str] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., method: _Optional[str] = ..., block_size: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("version", "acceptance_lengths", "tau", "ttft_ms", "latency_ms", "prefill_ms")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    version: int
    acceptance_lengths: _containers.RepeatedScalarFieldContainer[int]
    tau: float
    ttft_ms: float
    latency_ms: float
    prefill_ms: float
    def __init__(self, version: _Optional[int] = ..., acceptance_lengths: _Optional[_Iterable[int]] = ..., tau: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., latency_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("version", "token_ids", "text", "finished", "finish_reason", "stats")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    version: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    stats: Stats
    def __init__(self, version: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("version", "token_ids", "text", "finish_reason", "stats")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    version: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: Stats
    def __init__(self, version: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("version", "serving", "has_drafter", "has_tokenizer", "running", "waiting", "kv_blocks_free", "vocab_size", "kv_blocks_total", "kv_block_size", "max_positions", "default_block_size", "settings_json", "resumes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_JSON_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    version: int
    serving: bool
    has_drafter: bool
    has_tokenizer: bool
    running: int
    waiting: int
    kv_blocks_free: int
    vocab_size: int
    kv_blocks_total: int
    kv_block_size: int
    max_positions: int
    default_block_size: int
    settings_json: str
    resumes: bool
    def __init__(self, version: _Optional[int] = ..., serving: _Optional[bool] = ..., has_drafter: _Optional[bool] = ..., has_tokenizer: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., vocab_size: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., max_positions: _Optional[int] = ..., default_block_size: _Optional[int] = ..., settings_json: _Optional[str] = ..., resumes: _Optional[bool] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("version", "first_token", "finish_reason", "published_chunks", "cached_tokens", "prefill_ms", "handoff", "publish_ticket")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TICKET_FIELD_NUMBER: _ClassVar[int]
    version: int
    first_token: int
    finish_reason: str
    published_chunks: int
    cached_tokens: int
    prefill_ms: float
    handoff: Handoff
    publish_ticket: int
    def __init__(self, version: _Optional[int] = ..., first_token: _Optional[int] = ..., finish_reason: _Optional[str] = ..., published_chunks: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ..., publish_ticket: _Optional[int] = ...) -> None: ...

class AwaitPublishRequest(_message.Message):
    __slots__ = ("version", "ticket")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    version: int
    ticket: int
    def __init__(self, version: _Optional[int] = ..., ticket: _Optional[int] = ...) -> None: ...

class AwaitPublishReply(_message.Message):
    __slots__ = ("version", "published", "published_chunks", "error")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    version: int
    published: bool
    published_chunks: int
    error: str
    def __init__(self, version: _Optional[int] = ..., published: _Optional[bool] = ..., published_chunks: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("exporter_id", "exporter_address", "blob", "lease_id", "blocks", "epochs", "num_tokens", "prompt_digest")
    EXPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPORTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    exporter_id: str
    exporter_address: str
    blob: bytes
    lease_id: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    epochs: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    prompt_digest: bytes
    def __init__(self, exporter_id: _Optional[str] = ..., exporter_address: _Optional[str] = ..., blob: _Optional[bytes] = ..., lease_id: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., epochs: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("version", "exporter_id", "lease_id", "blocks", "epochs", "claim")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    version: int
    exporter_id: str
    lease_id: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    epochs: _containers.RepeatedScalarFieldContainer[int]
    claim: int
    def __init__(self, version: _Optional[int] = ..., exporter_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., epochs: _Optional[_Iterable[int]] = ..., claim: _Optional[int] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("version", "released")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    version: int
    released: bool
    def __init__(self, version: _Optional[int] = ..., released: _Optional[bool] = ...) -> None: ...

class OpenPairRequest(_message.Message):
    __slots__ = ("version", "exporter_id", "importer_id", "nonce", "seal")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    IMPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    exporter_id: str
    importer_id: str
    nonce: bytes
    seal: bytes
    def __init__(self, version: _Optional[int] = ..., exporter_id: _Optional[str] = ..., importer_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., seal: _Optional[bytes] = ...) -> None: ...

class OpenPairReply(_message.Message):
    __slots__ = ("version", "store_address", "geometry", "seal")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    store_address: str
    geometry: str
    seal: bytes
    def __init__(self, version: _Optional[int] = ..., store_address: _Optional[str] = ..., geometry: _Optional[str] = ..., seal: _Optional[bytes] = ...) -> None: ...

class SendLeaseRequest(_message.Message):
    __slots__ = ("version", "exporter_id", "nonce", "lease_id", "blocks", "epochs", "tag", "seal")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    exporter_id: str
    nonce: bytes
    lease_id: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    epochs: _containers.RepeatedScalarFieldContainer[int]
    tag: int
    seal: bytes
    def __init__(self, version: _Optional[int] = ..., exporter_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., lease_id: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., epochs: _Optional[_Iterable[int]] = ..., tag: _Optional[int] = ..., seal: _Optional[bytes] = ...) -> None: ...

class SendLeaseReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class PairStoreRequest(_message.Message):
    __slots__ = ("version", "exporter_id", "nonce", "op", "key", "value", "expected", "amount", "keys", "timeout_s", "seal")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPORTER_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    exporter_id: str
    nonce: bytes
    op: str
    key: str
    value: bytes
    expected: bytes
    amount: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    seal: bytes
    def __init__(self, version: _Optional[int] = ..., exporter_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., op: _Optional[str] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ..., seal: _Optional[bytes] = ...) -> None: ...

class PairStoreReply(_message.Message):
    __slots__ = ("version", "value", "number", "ok", "seal")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    version: int
    value: bytes
    number: int
    ok: bool
    seal: bytes
    def __init__(self, version: _Optional[int] = ..., value: _Optional[bytes] = ..., number: _Optional[int] = ..., ok: _Optional[bool] = ..., seal: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("version", "request", "first_token", "handoff", "resumed_output")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    version: int
    request: GenerateRequest
    first_token: int
    handoff: Handoff
    resumed_output: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., first_token: _Optional[int] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ..., resumed_output: _Optional[_Iterable[int]] = ...) -> None: ...
