"""TLS for the bridge's gRPC channel: what a bridge exposed beyond loopback should use.

Without it, chunks and the bearer token cross the network in the clear: the token (not the MAC
key, a separate subkey) could then be replayed to read or fill the store, though never to forge a
chunk a reader accepts. One BridgeTls is handed to both sides: the server uses cert and key; a
client trusts `ca` (None: the system's roots). The certificate must name the address clients dial
(for an IP address, an IP subjectAltName).
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class BridgeTls:
    cert: str | None = None  # PEM certificate chain of the server (file path)
    key: str | None = None  # its PEM private key (file path)
    ca: str | None = None  # PEM roots a client verifies the server against (file path)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS: a certificate and its private key go together (give both or neither)")

    @classmethod
    def from_paths(cls, cert: str | None, key: str | None, ca: str | None) -> "BridgeTls | None":
        """None when no TLS material is given (plaintext)."""
        return None if cert is None and key is None and ca is None else cls(cert, key, ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("TLS: serving needs a certificate and its private key")
        _check_pair(self.cert, self.key)
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if self.ca:
            _check_roots(self.ca)
        return grpc.ssl_channel_credentials(root_certificates=Path(self.ca).read_bytes() if self.ca else None)


def _check_pair(cert: str, key: str) -> None:
    """A ValueError naming the files unless they are a PEM certificate (chain) and its private key: gRPC took any
    bytes and failed the bind with "Failed to bind to address", which blamed the port."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # parse and match only: what gRPC (its own BoringSSL) serves is its call
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(f"tls_cert / tls_key: {cert} and {key} are not a PEM certificate and its (unencrypted) "
                         f"private key: {e}") from None


def _check_roots(ca: str) -> None:
    """A ValueError naming the file unless it holds PEM certificates (a client's roots)."""
    try:
        ssl.create_default_context(cafile=ca)
    except (ssl.SSLError, ValueError) as e:
        raise ValueError(f"tls_ca: {ca} holds no PEM certificate: {e}") from None


def _no_password() -> str:
    """An encrypted key is refused, never prompted for on a terminal (gRPC cannot use one either)."""
    raise ValueError("the key is encrypted")
