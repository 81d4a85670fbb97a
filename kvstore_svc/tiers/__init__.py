"""The KV store's tiers, fastest first: memory (LRU), local disk (LRU), Redis (shared by every store)."""

from kvstore_svc.tiers.base import EntryKey, Tier, TierStats

__all__ = ["EntryKey", "Tier", "TierStats"]
