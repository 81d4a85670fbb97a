"""The block keys' hash chain, moved to `services/prefix_hash.py` so the router (router_svc) hashes
prompts with the very same code without importing the scheduler; re-exported here for its users."""

from services.prefix_hash import (
    MAX_SALT_BYTES,
    ROOT_KEY,
    block_key,
    check_salt,
    extend_block_keys,
    root_key,
)

__all__ = ["MAX_SALT_BYTES", "ROOT_KEY", "block_key", "check_salt", "extend_block_keys", "root_key"]
