"""vLLM's shape of logprobs for the offline API: per position, a dict token id -> `Logprob`.

The engine hands back `TokenLogprobs` (the token, its logprob and rank, the top-k); vLLM's
`RequestOutput.prompt_logprobs` is a list with None for the first prompt token, then for
each position a dict holding the prompt token itself and its top-k alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.step import TokenLogprobs


@dataclass
class Logprob:
    """vLLM's `Logprob`: a token's logprob, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


def as_position_dicts(
    entries: Sequence[TokenLogprobs | None], tokenizer: Any = None
) -> list[PositionLogprobs | None]:
    """One dict per position (None where there is no entry); texts decoded when a tokenizer is given."""

    def text(token_id: int) -> str | None:
        return tokenizer.decode([token_id]) if tokenizer is not None else None

    out: list[PositionLogprobs | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {
            tid: Logprob(lp, rank, text(tid))
            for rank, (tid, lp) in enumerate(zip(e.top_token_ids, e.top_logprobs, strict=True), 1)
        }
        d[e.token_id] = Logprob(e.logprob, e.rank, text(e.token_id))  # vLLM puts the token itself first
        out.append({e.token_id: d.pop(e.token_id), **d})
    return out
