"""`cache_salt`: the prefix-cache isolation that reaches the scheduler as `GenerateRequest.cache_salt`.

A request's `cache_salt` (vLLM's field) is mixed by the scheduler into the key of the prompt's
first KV block, so requests with different salts never share a cached block nor learn, from
cache hits or timings, what another salt's requests sent. With `--cache-salt-by-api-key` the
gateway salts every request by the API key it presented: the salt sent is a hash of that key
(never the key itself: salts travel to the scheduler and may appear in its logs and KV
events), combined with the request's own salt, so tenants with different keys are apart
whatever salts they send, and a tenant can still split its own requests further.
"""

from __future__ import annotations

import hashlib

MAX_CACHE_SALT_BYTES = 256  # the scheduler's cap (generation.proto); a longer salt is refused there too
API_KEY_SCOPE = "llmesh.api_key"  # ASGI scope entry: the key the request authenticated with
_TENANT_DOMAIN = b"llmesh cache_salt by api key v1\0"  # this hash means nothing elsewhere


def check_cache_salt(value: str) -> str:
    """Validator of the request field: a given salt must be a real one, and fit the scheduler's cap."""
    if not value:
        raise ValueError("must be a non-empty string when given")
    size = len(value.encode("utf-8"))
    if size > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"must be at most {MAX_CACHE_SALT_BYTES} bytes of UTF-8, got {size}")
    return value


def tenant_salt(api_key: str) -> str:
    """The salt of a key's tenant: sha256 hex of the key (domain-separated), 64 characters."""
    return hashlib.sha256(_TENANT_DOMAIN + api_key.encode("utf-8")).hexdigest()


def effective_salt(request_salt: str | None, api_key: str | None) -> str:
    """What the scheduler receives: the request's salt, salted by the key's tenant when one is given.

    Key and salt go through one more sha256 (the tenant salt is fixed-length, so the pair is
    unambiguous): the result stays 64 characters, under the scheduler's cap whatever the
    request's own salt, and no choice of salt by one tenant lands in another tenant's space.
    """
    if api_key is None:
        return request_salt or ""
    tenant = tenant_salt(api_key)
    if not request_salt:
        return tenant
    return hashlib.sha256(f"{tenant}\n{request_salt}".encode()).hexdigest()
