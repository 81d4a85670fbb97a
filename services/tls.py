"""TLS for every llmesh gRPC server and channel: credentials built from PEM files named in the config.

One set of flags on every service (`TLSConfig`, mixed into each service's config):

    --tls-cert FILE        certificate chain this service presents (as a server; as a client too
                           under mutual TLS)
    --tls-key FILE         its private key
    --tls-ca FILE          CA bundle that signs the mesh's certificates: channels verify servers with
                           it; a server with --tls-client-auth verifies clients with it
    --tls-client-auth      mutual TLS: servers require a client certificate signed by --tls-ca,
                           and channels present --tls-cert/--tls-key
    --tls-server-name NAME the name checked in a server's certificate instead of the dialled host
                           (a worker is dialled by pod IP; one mesh certificate names the mesh)

A server listens with TLS when it has a certificate; a channel dials with TLS when the service has a
CA or a certificate (a service that serves TLS expects its peers to, too). Nothing set = plaintext,
which is what loopback meshes use. Files are read once, at start: a rotated certificate needs a
restart (Kubernetes rolls the pods).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from services.config import option


@dataclass
class TLSConfig:
    """TLS settings shared by every service: the flags above, checked together."""

    tls_cert: str = option("", help="PEM certificate chain this service presents (server; client under mTLS)")
    tls_key: str = option("", help="PEM private key of --tls-cert")
    tls_ca: str = option(
        "", help="PEM CA bundle signing peers' certificates (channels verify servers, mTLS servers clients)"
    )
    tls_client_auth: bool = option(
        False, help="mutual TLS: require client certificates signed by --tls-ca, present --tls-cert"
    )
    tls_server_name: str = option(
        "", help="name expected in servers' certificates (default: the host dialled)"
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_auth and not (self.tls_cert and self.tls_ca):
            raise ValueError("--tls-client-auth needs --tls-cert, --tls-key and --tls-ca")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')} {path}: no such file")

    @property
    def tls_dials(self) -> bool:
        """Whether the channels this service opens use TLS."""
        return bool(self.tls_ca or self.tls_cert)


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(config: TLSConfig) -> grpc.ServerCredentials | None:
    """Credentials for a server's port; None = plaintext (no certificate configured)."""
    if not config.tls_cert:
        return None
    pair = [(_read(config.tls_key), _read(config.tls_cert))]
    if config.tls_client_auth:
        return grpc.ssl_server_credentials(
            pair, root_certificates=_read(config.tls_ca), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)


def channel_credentials(config: TLSConfig) -> grpc.ChannelCredentials | None:
    """Credentials for the channels a service opens; None = plaintext."""
    if not config.tls_dials:
        return None
    client_pair = {}
    if config.tls_client_auth:
        client_pair = {"private_key": _read(config.tls_key), "certificate_chain": _read(config.tls_cert)}
    # No CA file: the system's roots (a scheduler behind a publicly signed certificate).
    return grpc.ssl_channel_credentials(root_certificates=_read(config.tls_ca), **client_pair)


def server_name_options(config: TLSConfig) -> list[tuple[str, str]]:
    """Channel options that check peers' certificates for the mesh name instead of the dialled host."""
    if config.tls_dials and config.tls_server_name:
        return [("grpc.ssl_target_name_override", config.tls_server_name)]
    return []
