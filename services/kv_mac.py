"""Keyed MACs of KV store entries: a forged, altered, truncated or swapped entry is a miss.

The KV store, its disk tier and Redis are untrusted storage: anyone who can write there (a
stranger on Redis's port, a copied disk, a buggy store) could otherwise change what another
user's prompt computes. Every entry a worker puts carries

    mac = HMAC-SHA256(tag_key, len|fingerprint, len|chunk key, len|header with mac empty,
                      len|digest of the payload)

where the digest is `kernels.kv_digest` (a keyed int8 GEMM over the payload's bytes, computed
where they are: on the GPU as the chunk is gathered or after it is uploaded), and both keys are
derived from the mesh secret (services/mesh_secret.py), so every worker of a mesh, and no one
else, can write entries the others accept. The fingerprint and key inside the MAC bind an entry
to its name: a valid entry stored under another key fails. The length prefixes keep the fields
from sliding into each other. No torch here: the worker computes the digest, this module only
signs and checks.
"""

from __future__ import annotations

import hashlib
import hmac

TAG_BYTES = 32
_DOMAIN = b"llmesh kv mac v1"


class KVMac:
    """The two keys one mesh secret gives: the digest's (kernels/kv_digest.py) and the tag's."""

    def __init__(self, mesh_secret: str | bytes) -> None:
        secret = mesh_secret.encode() if isinstance(mesh_secret, str) else bytes(mesh_secret)
        if not secret:
            raise ValueError("a KV MAC needs the mesh secret")
        root = hmac.new(secret, _DOMAIN, hashlib.sha256).digest()
        self.digest_secret = hmac.new(root, b"digest", hashlib.sha256).digest()
        self._tag_key = hmac.new(root, b"tag", hashlib.sha256).digest()

    def tag(self, fingerprint: bytes, key: bytes, signed_header: bytes, digest: bytes) -> bytes:
        """The MAC of one entry (32 bytes)."""
        h = hmac.new(self._tag_key, digestmod=hashlib.sha256)
        for part in (fingerprint, key, signed_header, digest):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()

    def verify(self, mac: bytes, fingerprint: bytes, key: bytes, signed_header: bytes, digest: bytes) -> bool:
        """Whether `mac` is this mesh's MAC of the entry (constant time; an empty mac never is)."""
        expected = self.tag(fingerprint, key, signed_header, digest)
        return len(mac) == TAG_BYTES and hmac.compare_digest(mac, expected)
