"""`--speculative-config`: which proposer the worker runs and how many tokens it drafts (vLLM's keys)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 2


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram (prompt lookup): the longest earlier match of the last n tokens, n in [min, max].
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # draft_model: a model with the target's tokenizer (None = the target's own weights), run
    # by this worker; num_layers > 0 keeps only its first layers (self-speculation by early exit).
    model: str | None = None
    num_layers: int = 0
    # No drafts while more sequences than this run (vLLM's key; 0 = never disabled). A sequence
    # that speculates waits for each result instead of being planned ahead, which a big batch
    # pays for in host time on every step (H100, SmolLM2, copying: 1.5x at 1, 0.84x at 4 and 16).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)}; got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size < 0:
            raise ValueError(f"disable_by_batch_size must be >= 0, got {self.disable_by_batch_size}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {self.num_layers}")
        if self.method == "draft_model" and self.model is None and not self.num_layers:
            raise ValueError("a draft_model needs a model, or num_layers of the target's to keep")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the JSON text of `--speculative-config`, a dict (`LLM(speculative_config=...)`), or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**value)
