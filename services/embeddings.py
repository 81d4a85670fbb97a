"""A pooled vector as callers get it: cut to `dimensions` (Matryoshka), then L2-normalized.

The worker returns the raw pooled hidden state (`StepResult.pooled`); the offline API
(`LLM.embed`) and the gateway (`/v1/embeddings`) finish it here alike, as vLLM's embedding
pooler does (normalize by default; `dimensions` truncates before normalizing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    """ValueError unless `dimensions` is None or in [1, hidden_size]."""
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden_size:
        raise ValueError(f"must be an integer in [1, {hidden_size}], got {dimensions!r}")


def finish_embedding(
    values: Sequence[float], dimensions: int | None = None, normalize: bool = True
) -> list[float]:
    """`values` cut to `dimensions` (None: whole) and, with `normalize`, scaled to unit length."""
    out = list(values[:dimensions] if dimensions is not None else values)
    if normalize:
        norm = math.sqrt(math.fsum(v * v for v in out))
        if norm > 0:
            out = [v / norm for v in out]
    return out
