"""The cluster secret: what makes the KV bridge a trust boundary.

One 32-byte secret per service start (or kept in a file across starts: `secret_file`), handed to every worker process
in FLASHPD_CLUSTER_SECRET (hex). Two independent subkeys are derived from it with BLAKE3's
derive_key mode: the chunk MAC key (every chunk carries a keyed BLAKE3 MAC over header and
payload), the bridge's gRPC bearer token and the workers' (Prefill, Decode, Release: what the
router and the decode workers call). They are separate so that a token seen on the wire (a
channel without TLS) lets nobody forge a chunk, and a worker's token read off a worker call
opens no bridge (its stored KV), nor the bridge's any worker. A process without the variable (a single
process, tests) uses a random secret of its own: MACs then still refuse anything made outside
the process. The secret never appears in repr, str, logs or exception text.
"""
from __future__ import annotations

import errno
import hmac
import os
import secrets
import stat
import tempfile
import threading
from typing import Iterable, Mapping

import blake3

ENV_VAR = "FLASHPD_CLUSTER_SECRET"
SECRET_BYTES = 32
MAC_BYTES = 32
_MAC_CONTEXT = "flashpd 2025 kv-bridge chunk MAC v1"
_TOKEN_CONTEXT = "flashpd 2025 kv-bridge gRPC bearer token v1"
_WORKER_TOKEN_CONTEXT = "flashpd 2026 worker gRPC bearer token v1"


class MacKey:
    """The chunk-MAC subkey: makes and checks keyed BLAKE3 tags (multi-threaded for large inputs)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) != SECRET_BYTES:
            raise ValueError(f"a MAC key has {SECRET_BYTES} bytes")
        self._key = bytes(key)

    def hasher(self, max_threads: int = blake3.blake3.AUTO) -> blake3.blake3:
        """A keyed hasher; AUTO threads for a whole chunk in one update, 1 where pieces stream through on
        several threads already (a frame's worth of threads cost more CPU than they save)."""
        return blake3.blake3(key=self._key, max_threads=max_threads)

    def tag(self, parts: Iterable[bytes | bytearray | memoryview]) -> bytes:
        """The MAC of the parts' concatenation (each hashed in place, never joined)."""
        h = self.hasher()
        for p in parts:
            h.update(p)
        return h.digest(MAC_BYTES)

    def verify(self, parts: Iterable[bytes | bytearray | memoryview], tag: bytes | memoryview) -> bool:
        return hmac.compare_digest(self.tag(parts), bytes(tag))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MacKey) and hmac.compare_digest(self._key, other._key)

    __hash__ = None  # type: ignore[assignment]  (compared, never used as a dict key)

    def __repr__(self) -> str:
        return "MacKey(<hidden>)"

    __str__ = __repr__


class ClusterSecret:
    """The service's shared secret (32 random bytes). Hands out subkeys, never itself, except to a
    child process through `child_env()` / `export_hex()`."""

    __slots__ = ("_secret", "_mac", "_token", "_worker_token")

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) != SECRET_BYTES:
            raise ValueError(f"a cluster secret is {SECRET_BYTES} bytes")
        self._secret = bytes(secret)
        self._mac = MacKey(blake3.blake3(self._secret, derive_key_context=_MAC_CONTEXT).digest())
        self._token = blake3.blake3(self._secret, derive_key_context=_TOKEN_CONTEXT).hexdigest()
        self._worker_token = blake3.blake3(self._secret, derive_key_context=_WORKER_TOKEN_CONTEXT).hexdigest()

    @classmethod
    def generate(cls) -> "ClusterSecret":
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str, source: str = "cluster secret") -> "ClusterSecret":
        """Parse a hex secret; the error names the source, never the value."""
        try:
            raw = bytes.fromhex(text.strip())
        except (ValueError, AttributeError):
            raise ValueError(f"{source}: not a hex string") from None
        if len(raw) != SECRET_BYTES:
            raise ValueError(f"{source}: {len(raw)} bytes, a cluster secret has {SECRET_BYTES} "
                             f"({2 * SECRET_BYTES} hex digits)")
        return cls(raw)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ClusterSecret":
        """The secret kept in `path` (hex), made and written there first if the file does not exist: a service
        that keeps its secret across starts keeps what was stored under it (a disk tier's entries). The file must
        be a regular file (not a link) of this process's user, with no group or other permission bits (created
        0600); errors name the file, never the value. A new file appears whole (written to a temporary file
        beside it, then linked into place), so a crash mid-write leaves no short secret behind, and of two starts
        creating it at once both read the one that was linked first."""
        name = f"secret file {os.fspath(path)}"
        try:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except FileNotFoundError:
                made = cls._create(os.fspath(path))
                if made is not None:
                    return made
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # another start linked it first
            try:  # the checks are of the file opened, not of whatever the name points to afterwards
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ValueError(f"{name}: not a regular file")
                if st.st_uid != os.geteuid():
                    raise ValueError(f"{name}: owned by uid {st.st_uid}, not by this process's user")
                if st.st_mode & 0o077:
                    raise ValueError(f"{name}: mode {st.st_mode & 0o777:o} lets other users read or change it; "
                                     f"make it the owner's alone (chmod 600)")
                text = os.read(fd, 4096).decode("ascii", errors="replace")
            finally:
                os.close(fd)
        except OSError as e:
            why = "a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))
            raise ValueError(f"{name}: cannot create or read it ({why})") from None
        return cls.from_hex(text, name)

    @classmethod
    def _create(cls, path: str) -> "ClusterSecret | None":
        """A fresh secret written whole at `path`, or None when another process created the file first."""
        fresh = cls.generate()
        fd, tmp = tempfile.mkstemp(prefix=".secret-", dir=os.path.dirname(path) or ".")  # 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(fresh.export_hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # never replaces a file: of two creators, one wins
            except FileExistsError:
                return None
        finally:
            os.unlink(tmp)
        return fresh

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ClusterSecret | None":
        """The secret in FLASHPD_CLUSTER_SECRET, or None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "")
        return cls.from_hex(text, ENV_VAR) if text else None

    @property
    def mac_key(self) -> MacKey:
        return self._mac

    @property
    def token(self) -> str:
        """The bridge's bearer token (hex): sent as gRPC metadata, so never log a call's metadata."""
        return self._token

    @property
    def worker_token(self) -> str:
        """The prefill and decode workers' bearer token (hex), as `token` is the bridge's."""
        return self._worker_token

    def export_hex(self) -> str:
        """The secret itself, for handing to a worker process (environment or actor argument) only."""
        return self._secret.hex()

    def child_env(self) -> dict[str, str]:
        """The environment entry that gives a child process this secret."""
        return {ENV_VAR: self.export_hex()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSecret) and hmac.compare_digest(self._secret, other._secret)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        raise TypeError("a ClusterSecret is not pickled: pass export_hex() to the process that needs it")

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    __str__ = __repr__


_process_secret: ClusterSecret | None = None
_process_lock = threading.Lock()


def process_secret() -> ClusterSecret:
    """This process's default: FLASHPD_CLUSTER_SECRET when set (a launched worker), else a random
    secret made once per process (nothing outside the process can then write a chunk it accepts)."""
    global _process_secret
    with _process_lock:
        if _process_secret is None:
            _process_secret = ClusterSecret.from_env() or ClusterSecret.generate()
        return _process_secret


def resolve(secret: ClusterSecret | None) -> ClusterSecret:
    """`secret`, or the process default when None (what every constructor taking a secret does)."""
    return secret if secret is not None else process_secret()
