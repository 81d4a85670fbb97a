"""Test certificates made at test time (trustme): one CA, certificates for the mesh, written to PEM files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class MeshCerts:
    ca: str  # PEM CA bundle
    cert: str  # PEM chain for every service (loopback names and "llmesh-mesh")
    key: str
    other_cert: str  # signed by another CA: a stranger's certificate
    other_key: str
    named_cert: str  # the same CA, only the name "llmesh-mesh" (no loopback address in it)
    named_key: str


def make_certs(folder: Path) -> MeshCerts:
    ca, stranger = trustme.CA(), trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost", "llmesh-mesh")
    foreign = stranger.issue_cert("127.0.0.1", "localhost")
    named = ca.issue_cert("llmesh-mesh")
    files = {
        "ca.pem": ca.cert_pem,
        "cert.pem": leaf.cert_chain_pems[0],
        "key.pem": leaf.private_key_pem,
        "other-cert.pem": foreign.cert_chain_pems[0],
        "other-key.pem": foreign.private_key_pem,
        "named-cert.pem": named.cert_chain_pems[0],
        "named-key.pem": named.private_key_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(folder / name))
    return MeshCerts(*(str(folder / n) for n in files))
